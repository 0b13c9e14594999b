"""CPU check of the register-fragment decode kernel's logic (``qerl_kernels.nvfp4_mmv``), which only
runs on a GPU: its per-lane data flow (which packed words, scales and activations each lane loads,
the word decode bit operations, the ``prmt`` activation pairs, the C-fragment output mapping) is
replayed in NumPy, with ``mma.sync.m16n8k16`` emulated from the PTX ISA's fragment tables, and
compared with the dequantize-then-matmul reference."""
import numpy as np
import pytest
import torch

from qerl.quant import nvfp4


def _bf16_bits_to_f64(b):
    return (np.asarray(b, np.uint32) << 16).view(np.float32).astype(np.float64)


def _f32_to_bf16_bits(v):
    # round-to-nearest-even (the values here are exact in bf16 anyway)
    u = np.asarray(v, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint32)


def _word_pairs(q, s2):
    """The kernel's PTX (`_word_pairs`): 4 bf16x2 pairs of nibbles (3-i, 7-i), times the pair s2."""
    out = []
    q = np.uint32(q)
    for _ in range(4):
        t = ((q & np.uint32(0x70007000)) >> np.uint32(6)) | (q & np.uint32(0x80008000))
        lo = _bf16_bits_to_f64(t & 0xFFFF) * _bf16_bits_to_f64(s2 & 0xFFFF)
        hi = _bf16_bits_to_f64(t >> 16) * _bf16_bits_to_f64(s2 >> 16)
        out.append(int(_f32_to_bf16_bits(lo)) | (int(_f32_to_bf16_bits(hi)) << 16))
        q = np.uint32((int(q) << 4) & 0xFFFFFFFF)
    return out


def _prmt(a, b, sel):
    pool = int(a).to_bytes(4, "little") + int(b).to_bytes(4, "little")
    return int.from_bytes(bytes(pool[(sel >> (4 * i)) & 7] for i in range(4)), "little")


def _mma(lanes_a, lanes_b, lanes_c):
    """mma.sync.m16n8k16.row.col f32.bf16.bf16.f32 from the PTX ISA fragment layouts."""
    A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    for lane in range(32):
        g, c = lane // 4, lane % 4
        for i in range(8):
            reg = lanes_a[lane][i // 2]
            A[g + 8 * ((i // 2) % 2), 2 * c + (i % 2) + 8 * (i // 4)] = _bf16_bits_to_f64((reg >> (16 * (i % 2))) & 0xFFFF)
        for i in range(4):
            reg = lanes_b[lane][i // 2]
            B[2 * c + (i % 2) + 8 * (i // 2), g] = _bf16_bits_to_f64((reg >> (16 * (i % 2))) & 0xFFFF)
        for i in range(4):
            C[g + 8 * (i // 2), 2 * c + (i % 2)] = lanes_c[lane][i]
    D = A @ B + C
    return [[D[lane // 4 + 8 * (i // 2), 2 * (lane % 4) + (i % 2)] for i in range(4)] for lane in range(32)]


def _scale2(sbits):
    s = float(torch.tensor([sbits], dtype=torch.uint8).view(torch.float8_e4m3fn).float()) * 2.0 ** 119
    b = int(_f32_to_bf16_bits(s))
    return b | (b << 16)


def _mmv_emulated(x, packed, scale, gs):
    """One warp per 16 weight rows, one 8-row activation block (a program's NB blocks share the
    decoded A fragments and repeat this per block), steps of 128 k: the kernel's loop."""
    M, K = x.shape
    N = packed.shape[0]
    pk = packed.numpy().view(np.uint32)  # [N, K/8] words (little endian)
    sc = scale.view(torch.uint8).numpy()
    xw = x.contiguous().view(torch.int16).numpy().view(np.uint32)  # [M, K/2] bf16 pairs
    y = np.zeros((M, N))
    for n0 in range(0, N, 16):
        for mb in range(0, M, 8):
            acc = [[0.0] * 4 for _ in range(32)]
            for t in range(K // 128):
                frags = []
                for lane in range(32):
                    g, c = lane // 4, lane % 4
                    na, nb, mx = min(n0 + g, N - 1), min(n0 + g + 8, N - 1), min(mb + g, M - 1)
                    w0, s0, x0 = t * 16 + 4 * c, t * 8 + 2 * c, t * 64 + 16 * c
                    qa = pk[na, w0: w0 + 4]
                    qb = pk[nb, w0: w0 + 4]
                    u = xw[mx, x0: x0 + 16]
                    sa = [_scale2(sc[na, s0 + j]) for j in range(2)]
                    sb = [_scale2(sc[nb, s0 + j]) for j in range(2)]
                    f = []
                    for w in range(4):
                        pa, pb = _word_pairs(qa[w], sa[w // 2]), _word_pairs(qb[w], sb[w // 2])
                        for h in range(2):
                            b0 = _prmt(u[4 * w + 1 - h], u[4 * w + 3 - h], 0x7632)
                            b1 = _prmt(u[4 * w + 1 - h], u[4 * w + 3 - h], 0x5410)
                            f.append(((pa[2 * h], pb[2 * h], pa[2 * h + 1], pb[2 * h + 1]), (b0, b1)))
                    frags.append(f)
                for j in range(8):  # the 8 MMAs of the step, in the kernel's order
                    acc = _mma([frags[ln][j][0] for ln in range(32)], [frags[ln][j][1] for ln in range(32)], acc)
            for lane in range(32):
                g, c = lane // 4, lane % 4
                for i, (m, n) in enumerate(((2 * c, g), (2 * c + 1, g), (2 * c, g + 8), (2 * c + 1, g + 8))):
                    if mb + m < M and n0 + n < N:
                        y[mb + m, n0 + n] = acc[lane][i] * 128.0 / float(gs)
    return y


def test_register_fragment_dataflow_matches_reference():
    g = torch.Generator().manual_seed(3)
    N, K, M = 20, 512, 5  # a partial 16-row block and a partial 8-row activation block, two 256-k steps
    packed, scale, gs = nvfp4.quantize(torch.randn(N, K, generator=g) * 0.05)
    x = torch.randn(M, K, generator=g).bfloat16()
    want = x.double() @ nvfp4.dequantize(packed, scale, gs, torch.float32).double().T
    got = _mmv_emulated(x, packed, scale, gs)
    # exact e2m1·scale into the MMA, 1/gs applied once: equal up to float64 summation order
    err = np.abs(got - want.numpy()).max() / np.abs(want.numpy()).max()
    assert err < 1e-6, err
    assert np.abs(got).max() > 0


def _lora_emulated(xa, lb):
    """The kernel's ``_lora``: ``lora_b`` rows as the MMA's A (rows g, g+8 of each 16-row warp block;
    32-bit words 8j + c and 8j + c + 4 of the row), ``xa`` rows as its B (activation row g: words
    8j + c, 8j + c + 4), R / 16 MMAs into a zero C; output mapped like the main accumulator."""
    M, R = xa.shape
    N = lb.shape[0]
    lw = lb.contiguous().view(torch.int16).numpy().view(np.uint32)  # [N, R/2] bf16 pairs
    xw = xa.contiguous().view(torch.int16).numpy().view(np.uint32)  # [M, R/2]
    y = np.zeros((M, N))
    for n0 in range(0, N, 16):
        for mb in range(0, M, 8):
            acc = [[0.0] * 4 for _ in range(32)]
            for j in range(R // 16):
                fa, fb = [], []
                for lane in range(32):
                    g, c = lane // 4, lane % 4
                    ra, rb, mx = min(n0 + g, N - 1), min(n0 + g + 8, N - 1), min(mb + g, M - 1)
                    fa.append((lw[ra, 8 * j + c], lw[rb, 8 * j + c], lw[ra, 8 * j + c + 4], lw[rb, 8 * j + c + 4]))
                    fb.append((xw[mx, 8 * j + c], xw[mx, 8 * j + c + 4]))
                acc = _mma(fa, fb, acc)
            for lane in range(32):
                g, c = lane // 4, lane % 4
                for i, (m, n) in enumerate(((2 * c, g), (2 * c + 1, g), (2 * c, g + 8), (2 * c + 1, g + 8))):
                    if mb + m < M and n0 + n < N:
                        y[mb + m, n0 + n] = acc[lane][i]
    return y


def test_lora_epilogue_fragments_match_xa_times_lora_b():
    g = torch.Generator().manual_seed(4)
    M, N, R = 11, 37, 32  # partial row blocks on both sides, two k16 MMAs over the rank
    xa = torch.randn(M, R, generator=g).bfloat16()
    lb = torch.randn(N, R, generator=g).bfloat16()
    want = xa.double() @ lb.double().T
    got = _lora_emulated(xa, lb)
    assert np.abs(got - want.numpy()).max() / np.abs(want.numpy()).max() < 1e-6

