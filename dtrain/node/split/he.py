"""HE-LoRA: the LoRA expert's `A h` computed on a CKKS-encrypted hidden state (SEAL through tenseal).

Packing, for one ciphertext of `slots` = poly_modulus_degree / 2 slots, with d padded to dp (a power
of two) and each (position t, rank k) pair given one block of dp slots:

    slot:        | block 0        | block 1        | ... | block n-1      | zeros ...
    ciphertext:  | h_t0  0..0     | h_t0  0..0     | ... | h_tn  0..0     |
    plaintext:   | A_0   0..0     | A_1   0..0     | ... | A_k   0..0     |
    product, then rotate-left-and-add by 1, 2, 4, ..., dp/2 (log2 dp rotations):
    slot b*dp == sum_j A_k[j] h_t[j] == (A h_t)_k

The r ranks of one position are adjacent blocks, so a ciphertext holds `slots // (r * dp)` whole
positions; when one position does not fit (r * dp > slots) its ranks spread over several ciphertexts.
Each ciphertext is decrypted once, and `B (A h) * scale` is finished in plaintext.
"""
from __future__ import annotations

import math
import threading
import time
from typing import Sequence

import numpy as np
import tenseal.sealapi as seal

from dtrain.node.split.kv_cache import SplitError
from hivemind.utils.logging import get_logger

logger = get_logger(__name__)


class HEError(SplitError):
    """An HE-LoRA request cannot be computed with this context (shapes, capacity)."""


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


class HEContext:
    """CKKS keys and evaluators. The node holds the secret key: this protects the LoRA intermediates in
    memory and on the wire between HE workers, not from the node itself."""

    def __init__(
        self,
        poly_modulus_degree: int = 8192,
        coeff_mod_bit_sizes: Sequence[int] = (60, 40, 40, 60),
        scale_bits: int = 40,
    ):
        if poly_modulus_degree < 1024 or poly_modulus_degree & (poly_modulus_degree - 1):
            raise ValueError(f"poly_modulus_degree must be a power of two >= 1024, got {poly_modulus_degree!r}")
        if len(coeff_mod_bit_sizes) < 3:
            raise ValueError("coeff_mod_bit_sizes needs at least 3 primes: one for data, one to rescale, one special")
        self.poly_modulus_degree = poly_modulus_degree
        self.coeff_mod_bit_sizes = tuple(coeff_mod_bit_sizes)
        self.scale = float(2**scale_bits)
        parms = seal.EncryptionParameters(seal.SCHEME_TYPE.CKKS)
        parms.set_poly_modulus_degree(poly_modulus_degree)
        parms.set_coeff_modulus(seal.CoeffModulus.Create(poly_modulus_degree, list(self.coeff_mod_bit_sizes)))
        self._context = seal.SEALContext(parms, True, seal.SEC_LEVEL_TYPE.TC128)
        if not self._context.parameters_set():
            raise ValueError(f"invalid CKKS parameters: {self._context.parameters_error_message()}")
        keygen = seal.KeyGenerator(self._context)
        public_key = seal.PublicKey()
        keygen.create_public_key(public_key)
        self._encoder = seal.CKKSEncoder(self._context)
        self.slot_count = self._encoder.slot_count()
        # left rotations by 1, 2, 4, ..., slots/2: the rotate-and-sum of any block size up to all slots
        self.rotation_steps = tuple(1 << i for i in range(int(math.log2(self.slot_count))))
        self._galois_keys = seal.GaloisKeys()
        # The bindings' list overload takes Galois elements, not steps: a left rotation by s slots is
        # the automorphism x -> x^(3^s mod 2N) (SEAL's GaloisTool::get_elt_from_step).
        galois_elts = [pow(3, step, 2 * poly_modulus_degree) for step in self.rotation_steps]
        keygen.create_galois_keys(galois_elts, self._galois_keys)
        self._encryptor = seal.Encryptor(self._context, public_key)
        self._evaluator = seal.Evaluator(self._context)
        self._decryptor = seal.Decryptor(self._context, keygen.secret_key())
        # one HE computation at a time: the SEAL objects are shared and the bindings hold the GIL anyway
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"HEContext(poly_modulus_degree={self.poly_modulus_degree}, coeff_mod_bit_sizes={self.coeff_mod_bit_sizes})"

    # ---- primitives (callers hold _lock)

    def _encrypt(self, values: np.ndarray) -> seal.Ciphertext:
        plain = seal.Plaintext()
        self._encoder.encode(values.tolist(), self.scale, plain)
        ct = seal.Ciphertext()
        self._encryptor.encrypt(plain, ct)
        return ct

    def _mul_plain_rescale(self, ct: seal.Ciphertext, values: np.ndarray) -> None:
        plain = seal.Plaintext()
        self._encoder.encode(values.tolist(), ct.parms_id(), self.scale, plain)
        self._evaluator.multiply_plain_inplace(ct, plain)
        self._evaluator.rescale_to_next_inplace(ct)

    def _block_sums(self, ct: seal.Ciphertext, block: int) -> None:
        """Slot b*block becomes the sum of slots b*block .. b*block+block-1 (log2(block) rotations)."""
        step = 1
        while step < block:
            rotated = seal.Ciphertext()
            self._evaluator.rotate_vector(ct, step, self._galois_keys, rotated)
            self._evaluator.add_inplace(ct, rotated)
            step <<= 1

    def _decrypt(self, ct: seal.Ciphertext) -> np.ndarray:
        plain = seal.Plaintext()
        self._decryptor.decrypt(ct, plain)
        return np.asarray(self._encoder.decode_double(plain), dtype=np.float64)


def he_lora_delta(
    ctx: HEContext, h: np.ndarray, A: np.ndarray, B: np.ndarray, scale: float
) -> tuple[np.ndarray, dict[str, float]]:
    """`B (A h) * scale` with `A h` computed under CKKS; `h` is [d] or [T, d]. Returns (delta like h, timings).

    Timings in milliseconds: `encrypt_ms` (encode + encrypt h), `compute_ms` (encrypted multiply,
    rescale and rotate-and-sum, plus the plaintext B product), `decrypt_ms` (decrypt + decode).
    """
    h = np.asarray(h)
    single = h.ndim == 1
    hs = h[None, :] if single else h  # (T, d)
    if hs.ndim != 2 or hs.shape[0] < 1:
        raise HEError(f"expected hidden states [d] or [T, d], got shape {h.shape}")
    A = np.asarray(A, dtype=np.float64)
    B = np.asarray(B, dtype=np.float64)
    T, d = hs.shape
    if A.ndim != 2 or A.shape[1] != d or B.shape != (d, A.shape[0]):
        raise HEError(f"LoRA shapes do not match hidden size {d}: A {A.shape} (want [r, {d}]), B {B.shape} (want [{d}, r])")
    r = A.shape[0]
    dp = _next_pow2(d)
    if dp > ctx.slot_count:
        raise HEError(f"hidden size {d} needs {dp} slots per block; this context has {ctx.slot_count} (raise poly_modulus_degree)")
    blocks_per_ct = ctx.slot_count // dp
    total_blocks = T * r  # block b = (t, k) with t = b // r, k = b % r

    # every block's h_t and A_k, padded to dp, laid out once; ciphertext c takes blocks [c*n, (c+1)*n)
    h_pad = np.zeros((T, dp))
    h_pad[:, :d] = hs
    A_pad = np.zeros((r, dp))
    A_pad[:, :d] = A
    h_blocks = np.repeat(h_pad, r, axis=0)  # (T*r, dp): row b is h_{b // r}
    A_blocks = np.tile(A_pad, (T, 1))  # (T*r, dp): row b is A_{b % r}

    encrypt_s = compute_s = decrypt_s = 0.0
    ah = np.empty(total_blocks)  # (A h_t)_k at index t*r + k
    with ctx._lock:
        for start in range(0, total_blocks, blocks_per_ct):
            stop = min(start + blocks_per_ct, total_blocks)
            n = stop - start
            t0 = time.perf_counter()
            ct = ctx._encrypt(_slots(h_blocks[start:stop], ctx.slot_count))
            t1 = time.perf_counter()
            ctx._mul_plain_rescale(ct, _slots(A_blocks[start:stop], ctx.slot_count))
            ctx._block_sums(ct, dp)
            t2 = time.perf_counter()
            ah[start:stop] = ctx._decrypt(ct)[: n * dp : dp]
            t3 = time.perf_counter()
            encrypt_s += t1 - t0
            compute_s += t2 - t1
            decrypt_s += t3 - t2
    t0 = time.perf_counter()
    delta = (ah.reshape(T, r) @ B.T) * scale  # (T, d)
    compute_s += time.perf_counter() - t0
    timings = {"encrypt_ms": encrypt_s * 1e3, "compute_ms": compute_s * 1e3, "decrypt_ms": decrypt_s * 1e3}
    delta = delta.astype(np.float32)
    return (delta[0] if single else delta), timings


def _slots(blocks: np.ndarray, slot_count: int) -> np.ndarray:
    """Blocks [n, dp] laid end to end and zero-padded to the slot count."""
    out = np.zeros(slot_count)
    flat = blocks.reshape(-1)
    out[: flat.size] = flat
    return out
