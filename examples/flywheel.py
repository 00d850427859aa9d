"""The flywheel: a scripted agent calls a live node through the official `openai` client, rewards what it served,
and the node's feedback training makes the next answers better. Prints the success rate before and after.

    nice -n 19 .venv/bin/python examples/flywheel.py            # about 6 minutes on 2 CPU cores

The script starts one `dtrain-node` (tiny model from configs/tiny.json, random init: nothing is downloaded) with
`--feedback-train`, alone in its own swarm, training on nothing but the rewards. The task is copying: the prompt
`"repeat: cat ->"` is answered correctly by `" cat"`. A randomly initialised model never copies exactly, so the
agent grades every answer (the first line of the completion, stripped) against the target with a character-level
similarity in [0, 1] (difflib's ratio: 2 * matching characters / total characters), and reports both that graded
score and the exact-match rate.

Each round the agent asks every question `--samples` times (n choices, temperature 1), rewards each choice with
its score minus the mean score of its question's choices, scaled to [-1, 1] (better-than-its-siblings answers
pulled, worse ones pushed away: a baseline, as in policy-gradient methods), posts the rewards to `/v1/feedback`,
and waits until the node has trained on every rewarded row (it reads the node's capture db, read-only) and serves
the resulting step. Before the first round and after the last it evaluates: one greedy answer per question
(temperature 0) and `--samples` sampled ones (fixed seeds), graded the same way.

With `--lora NAME` the node trains the LoRA adapter NAME (`--feedback-lora`) instead of the shared model, the
agent asks `model=NAME`, and each round is one update of the adapter, hot-swapped into serving.
"""
from __future__ import annotations

import argparse
import difflib
import json
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from openai import OpenAI

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny.json"
READY = "Join it from another machine with"
START_TIMEOUT_S = 60.0  # a node starts in seconds; one that does not hangs somewhere its stacks show
# one GPT-2 token each with the leading space the prompt's " ->" is followed by
WORDS = ("cat", "dog", "red", "sun", "map", "box", "hat", "pen")


@dataclass(frozen=True)
class Score:
    graded: float  # mean difflib ratio in [0, 1]
    exact: float  # fraction of answers equal to the target


def answer_of(text: str) -> str:
    """What the agent reads as the answer: the completion's first line, stripped."""
    return text.strip().split("\n", 1)[0].strip()


def grade(text: str, target: str) -> float:
    return difflib.SequenceMatcher(None, answer_of(text), target).ratio()


def prompt_of(word: str) -> str:
    return f"repeat: {word} ->"


def start_node(args, work: Path) -> tuple[subprocess.Popen, str, Path]:
    train = work / "train_config.json"
    train.write_text(json.dumps({"learning_rate": args.lr, "weight_decay": 0.0}))
    port = _free_port()
    db = work / "capture.sqlite"
    cmd = [sys.executable, "-m", "dtrain.cli", "--host", "127.0.0.1", "--port", str(port),
           "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--run-id", f"flywheel-{port}",
           "--model-config", str(args.model_config), "--train-config", str(train), "--no-data",
           *training_flags(args), "--feedback-interval", "0.5", "--feedback-batch", "1024",
           "--capture-db", str(db), "--serve-max-n", str(args.samples), "--serve-max-batch", str(4 * args.samples),
           "--matchmaking-time", "2.5", "--request-timeout", "1.0", "--averaging-timeout", "8",
           "--log-level", "INFO"]
    log = work / "node.log"
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_TIMEOUT_S
    while READY not in log.read_text():
        if proc.poll() is not None:
            raise SystemExit(f"the node exited with {proc.returncode}; its log:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            proc.send_signal(signal.SIGUSR1)  # the node writes every thread's stack into its log (dtrain.cli)
            time.sleep(1.0)
            proc.kill()
            raise SystemExit(f"the node did not start within {START_TIMEOUT_S:.0f} s; its log ends with every "
                             f"thread's stack:\n{log.read_text()[-12000:]}")
        time.sleep(0.5)
    return proc, f"http://127.0.0.1:{port}", db


def training_flags(args) -> list[str]:
    """The shared model's feedback training, or with --lora an adapter's (updated once per round: its target is
    a round's answers)."""
    if args.lora is None:
        return ["--feedback-train"]
    return ["--feedback-lora", args.lora, "--feedback-lora-lr", str(args.lr),
            "--feedback-lora-target", str(len(WORDS) * args.samples)]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served_step(base_url: str, model: str) -> int:
    """The version `model` serves now: the shared model's step, or an adapter's epoch."""
    with urllib.request.urlopen(f"{base_url}/v1/models/{model}", timeout=10) as r:
        entry = json.loads(r.read())
    return int(entry["dtrain_adapter"]["epoch"] if "dtrain_adapter" in entry else entry["dtrain_step"])


def wait_trained(base_url: str, model: str, db: Path, timeout_s: float) -> int:
    """Until every rewarded row went into a contribution (or the adapter's gradients) and `model` serves the
    version after it; that version."""
    deadline = time.monotonic() + timeout_s
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        while time.monotonic() < deadline:
            # rows rewarded 0 (every choice of a question alike) are marked trained without an update: only the
            # newest row that carried a signal needs a newer served version
            pending, last = con.execute("SELECT (SELECT count(*) FROM completions WHERE reward IS NOT NULL AND "
                                        "trained_step IS NULL), (SELECT max(trained_step) FROM completions WHERE "
                                        "reward != 0)").fetchone()
            if pending == 0 and last is None:
                return served_step(base_url, model)  # nothing to learn from yet
            if pending == 0:
                step = served_step(base_url, model)
                if step > last:
                    return step
            time.sleep(0.3)
    finally:
        con.close()
    log = (db.parent / "node.log").read_text().splitlines()
    raise SystemExit(f"the node did not train on the feedback within {timeout_s:.0f} s; its log ends:\n"
                     + "\n".join(log[-60:]))


def evaluate(client: OpenAI, model: str, samples: int, max_tokens: int) -> tuple[Score, Score, list[str]]:
    """(greedy score, sampled score, the greedy answers)."""
    greedy_g, greedy_x, sampled_g, sampled_x, answers = [], [], [], [], []
    for i, word in enumerate(WORDS):
        r = client.completions.create(model=model, prompt=prompt_of(word), max_tokens=max_tokens, temperature=0,
                                      stop=["\n"])
        text = r.choices[0].text
        answers.append(answer_of(text))
        greedy_g.append(grade(text, word))
        greedy_x.append(answer_of(text) == word)
        r = client.completions.create(model=model, prompt=prompt_of(word), max_tokens=max_tokens, temperature=1,
                                      n=samples, seed=1_000_000 + i * samples, stop=["\n"])
        for c in r.choices:
            sampled_g.append(grade(c.text, word))
            sampled_x.append(answer_of(c.text) == word)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return (Score(mean(greedy_g), mean(greedy_x)), Score(mean(sampled_g), mean(sampled_x)), answers)


def feedback_round(client: OpenAI, model: str, round_: int, samples: int, max_tokens: int) -> float:
    """Ask, grade, reward; returns the round's mean graded score."""
    scores = []
    for i, word in enumerate(WORDS):
        r = client.completions.create(model=model, prompt=prompt_of(word), max_tokens=max_tokens, temperature=1,
                                      n=samples, seed=(round_ * len(WORDS) + i) * samples, stop=["\n"])
        graded = [grade(c.text, word) for c in r.choices]
        scores += graded
        baseline = sum(graded) / len(graded)
        spread = max(graded) - min(graded)
        for c, g in zip(r.choices, graded):
            reward = 0.0 if spread == 0 else (g - baseline) / spread  # in [-1, 1]; 0 when all were alike
            client.post("/feedback", body={"id": r.id, "index": c.index, "reward": reward,
                                           "feedback_token": r.model_extra["dtrain_feedback_token"]}, cast_to=object)
    return sum(scores) / len(scores)


def main(argv: Optional[list[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=20, help="feedback rounds (the node trains on each before the next)")
    p.add_argument("--samples", type=int, default=32, help="choices per question per round (n)")
    p.add_argument("--max-tokens", type=int, default=2, help="tokens per answer")
    p.add_argument("--lr", type=float, default=0.1, help="the node's AdamW learning rate")
    p.add_argument("--model-config", default=str(TINY))
    p.add_argument("--lora", metavar="NAME", help="train the LoRA adapter NAME (--feedback-lora) instead of the "
                                                 "shared model, and ask model=NAME")
    args = p.parse_args(argv)
    model = args.lora or json.loads(Path(args.model_config).read_text())["name"]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="flywheel-") as tmp:
        proc, base_url, db = start_node(args, Path(tmp))
        try:
            client = OpenAI(base_url=base_url + "/v1", api_key="unused", timeout=60, max_retries=0)
            versions = [served_step(base_url, model)]
            print(f"node up at {base_url} (model {model}, version {versions[0]}, lr {args.lr}); "
                  f"{len(WORDS)} questions, {args.samples} samples each, {args.rounds} rounds", flush=True)
            before = evaluate(client, model, args.samples, args.max_tokens)
            print(f"before: greedy graded {before[0].graded:.3f} exact {before[0].exact:.3f} | sampled graded "
                  f"{before[1].graded:.3f} exact {before[1].exact:.3f} | answers {before[2]}", flush=True)
            for round_ in range(args.rounds):
                score = feedback_round(client, model, round_, args.samples, args.max_tokens)
                step = wait_trained(base_url, model, db, timeout_s=120)
                versions.append(step)
                print(f"round {round_ + 1:2d}: sampled graded {score:.3f}, trained -> "
                      f"{'epoch' if args.lora else 'step'} {step}", flush=True)
            after = evaluate(client, model, args.samples, args.max_tokens)
            print(f"after:  greedy graded {after[0].graded:.3f} exact {after[0].exact:.3f} | sampled graded "
                  f"{after[1].graded:.3f} exact {after[1].exact:.3f} | answers {after[2]}", flush=True)
            print(f"total {time.monotonic() - started:.0f} s", flush=True)
            return {"before": before, "after": after, "versions": versions}
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


if __name__ == "__main__":
    main()
