#!/usr/bin/env python3
# The per-token prefill tile's fragment algebra (msa_token_tile_kernel, src/ops/msa_attention), on
# the CPU: one warp and one 64-key chunk, bf16 and e4m3 pages, emulating ldmatrix (.trans),
# movmatrix.trans and mma.m16n8k16 (row.col) on their documented fragment layouts, the stage and
# query swizzles, the kernel's lane-base-XOR-step addresses, the e4m3 in-place conversion order and
# byte permute, and the output mapping; checked against K Q^T and (K Q^T)^T V computed directly
# (P := S: a test of where values go, not of the softmax). Needs numpy. Keep it in step with the
# kernel when its addressing changes. Usage: scripts/token-tile-layout.py (prints max errors: 0).
import numpy as np
rng = np.random.default_rng(1)

def e4m3_decode(b):
    b = int(b); s = -1.0 if b & 0x80 else 1.0; e = (b >> 3) & 15; m = b & 7
    if e == 0: return s * (m / 8.0) * 2.0**-6
    if e == 15 and m == 7: return float('nan')
    return s * (1 + m / 8.0) * 2.0**(e - 7)

class Smem:
    def __init__(s, n): s.b = np.zeros(n, dtype=np.uint8); s.v = {}  # v: 16-bit element value by address
    def put16(s, addr, val): s.v[addr] = val
    def get16(s, addr): return s.v[addr]
    def get8(s, addr): return int(s.b[addr])

def ldsm_x4(sm, addrs, trans, bytes_mode=False):
    # addrs[lane]; matrix i rows from lanes 8i..8i+7; returns regs[lane][i] as tuple of two 16-bit items
    regs = [[None]*4 for _ in range(32)]
    for i in range(4):
        rows = [addrs[8*i + j] for j in range(8)]
        for t in range(32):
            g, c = t // 4, t % 4
            if not trans:
                els = [(rows[g], 2*c), (rows[g], 2*c+1)]
            else:
                els = [(rows[2*c], g), (rows[2*c+1], g)]
            if bytes_mode:  # each 16-bit element = 2 bytes
                regs[t][i] = tuple((sm.get8(r + 2*k), sm.get8(r + 2*k + 1)) for (r, k) in els)
            else:
                regs[t][i] = tuple(sm.get16(r + 2*k) for (r, k) in els)
    return regs

def movt(a):  # a[lane] = (M[g][2c], M[g][2c+1]) -> d[lane] = (M[2c][g], M[2c+1][g])
    M = np.zeros((8, 8))
    for t in range(32):
        g, c = t // 4, t % 4
        M[g][2*c], M[g][2*c+1] = a[t]
    return [(M[2*(t%4)][t//4], M[2*(t%4)+1][t//4]) for t in range(32)]

def mma(acc, a, b):
    # acc[lane] = [c0..c3]; a[lane] = (a0,a1,a2,a3) each a pair; b[lane] = (b0,b1) each a pair
    A = np.zeros((16, 16)); B = np.zeros((16, 8))
    for t in range(32):
        g, c = t // 4, t % 4
        a0, a1, a2, a3 = a[t]
        A[g][2*c:2*c+2] = a0; A[g+8][2*c:2*c+2] = a1; A[g][2*c+8:2*c+10] = a2; A[g+8][2*c+8:2*c+10] = a3
        b0, b1 = b[t]
        B[2*c:2*c+2, g] = b0; B[2*c+8:2*c+10, g] = b1
    C = A @ B
    for t in range(32):
        g, c = t // 4, t % 4
        acc[t][0] += C[g][2*c]; acc[t][1] += C[g][2*c+1]; acc[t][2] += C[g+8][2*c]; acc[t][3] += C[g+8][2*c+1]

def run(fp8, tma):
    G, warp = 16, 3
    kRow = 256 if fp8 else 512
    kRs, kBox = (128 if tma else kRow), 64 * 128
    st, q_s = 4096, 65536 * 2  # 1024-aligned
    sm = Smem(65536 * 4)
    # logical data
    if fp8:
        kb = rng.integers(0x20, 0x50, size=(64, 128)); vb = rng.integers(0x20, 0x50, size=(64, 128))
        kb = np.where(rng.random((64, 128)) < .5, kb, kb | 0x80); vb = np.where(rng.random((64, 128)) < .5, vb, vb | 0x80)
        K = np.vectorize(e4m3_decode)(kb); V = np.vectorize(e4m3_decode)(vb)
        for r in range(64):
            for d in range(128):
                if tma:  # boxes K, V: [64 keys][128 bytes], piece q at q ^ (r % 8)
                    sm.b[st + r*128 + (((d // 16) ^ (r & 7)) << 4) + d % 16] = kb[r][d]
                    sm.b[st + kBox + r*128 + (((d // 16) ^ (r & 7)) << 4) + d % 16] = vb[r][d]
                else:
                    sm.b[st + r*kRow + (((d // 16) ^ (r & 7)) << 4) + d % 16] = kb[r][d]
                    sm.b[st + r*kRow + ((8 + (d // 16)) ^ (r & 7)) * 16 + d % 16] = vb[r][d]
    else:
        K = rng.integers(-4, 5, size=(64, 128)).astype(float); V = rng.integers(-4, 5, size=(64, 128)).astype(float)
        for r in range(64):
            for d in range(128):
                if tma:  # boxes K 0-63, K 64-127, V 0-63, V 64-127: [64 keys][128 bytes]
                    q = (d % 64) // 8
                    sm.put16(st + (d // 64) * kBox + r*128 + ((q ^ (r & 7)) << 4) + (d % 8) * 2, K[r][d])
                    sm.put16(st + (2 + d // 64) * kBox + r*128 + ((q ^ (r & 7)) << 4) + (d % 8) * 2, V[r][d])
                else:
                    sm.put16(st + r*kRow + (((d // 8) ^ (r & 7)) << 4) + (d % 8) * 2, K[r][d])
                    sm.put16(st + r*kRow + (((16 + d // 8) ^ (r & 7)) << 4) + (d % 8) * 2, V[r][d])
    Q = rng.integers(-4, 5, size=(G, 128)).astype(float)
    for h in range(G):
        row = warp * G + h
        for d in range(128):
            sm.put16(q_s + row * 256 + (((d // 8) ^ (row & 7)) << 4) + (d % 8) * 2, Q[h][d])
    # lane bases
    k_lane = [0]*32; v_lane = [0]*32; q_lane = [0]*32
    for lane in range(32):
        mi, x, g, cq = lane // 8, lane % 8, lane // 4, lane % 4
        if fp8:
            k_lane[lane] = (mi * 8 + x) * kRs + (x << 4)
            v_lane[lane] = (kBox if tma else 128) + ((mi & 1) * 8 + x) * kRs + (((mi >> 1) ^ x) << 4)
            q_lane[lane] = (warp * G + g) * 256 + (((cq >> 1) ^ (g & 7)) << 4) + (cq & 1) * 8
        else:
            k_lane[lane] = ((mi & 1) * 8 + x) * kRs + (((mi >> 1) ^ x) << 4)
            v_lane[lane] = (2 * kBox if tma else 256) + ((mi >> 1) * 8 + x) * kRs + (((mi & 1) ^ x) << 4)
            q_lane[lane] = q_s + (warp * G + (mi >> 1) * 8 + x) * 256 + (((mi & 1) ^ x) << 4)
    sc = [[[[0.0]*4 for _ in range(32)] for _ in range(2)] for _ in range(4)]  # [mt][nt][lane][4]
    def cvt(pair_bytes):  # two e4m3 bytes -> pair of floats
        return (e4m3_decode(pair_bytes[0]), e4m3_decode(pair_bytes[1]))
    for ks in range(8):
        if fp8:
            qb = []
            for lane in range(32):
                a = q_s + (q_lane[lane] ^ (ks << 5))
                q0 = tuple(sm.get16(a + 2*i) for i in range(4)); q1 = tuple(sm.get16(a + 2048 + 2*i) for i in range(4))
                qb.append(((q0[0:2], q0[2:4]), (q1[0:2], q1[2:4])))
            for half in range(2):
                regs = ldsm_x4(sm, [(st + k_lane[l] + half * 32 * kRs) ^ (ks << 4) for l in range(32)], False, True)
                for t2 in range(2):
                    A = []
                    for lane in range(32):
                        r0 = regs[lane][2*t2]; r1 = regs[lane][2*t2+1]  # each: ((b0,b1),(b2,b3))
                        a0 = cvt(r0[0]); a2 = cvt(r0[1]); a1 = cvt(r1[0]); a3 = cvt(r1[1])
                        A.append((a0, a1, a2, a3))
                    for nt in range(2):
                        mma(sc[half*2+t2][nt], A, [qb[l][nt] for l in range(32)])
        else:
            qr = ldsm_x4(sm, [q_lane[l] ^ (ks << 5) for l in range(32)], False)
            qb = [((qr[l][0], qr[l][1]), (qr[l][2], qr[l][3])) for l in range(32)]
            for mt in range(4):
                ka = [(((st + k_lane[l]) ^ ((ks & 3) << 5)) + (ks >> 2) * kBox) if tma else ((st + k_lane[l]) ^ (ks << 5))
                      for l in range(32)]
                regs = ldsm_x4(sm, [ka[l] + mt * 16 * kRs for l in range(32)], False)
                A = [tuple(regs[l]) for l in range(32)]
                for nt in range(2):
                    mma(sc[mt][nt], A, [qb[l][nt] for l in range(32)])
    # check S^T = K Q^T: sc[mt][nt][lane] = S[key 16mt + g (+8)][head 8nt + 2c (+1)]
    S = K @ Q.T
    err = 0
    for mt in range(4):
        for nt in range(2):
            for lane in range(32):
                g, c = lane // 4, lane % 4
                want = [S[16*mt+g][8*nt+2*c], S[16*mt+g][8*nt+2*c+1], S[16*mt+g+8][8*nt+2*c], S[16*mt+g+8][8*nt+2*c+1]]
                err = max(err, max(abs(a - b) for a, b in zip(sc[mt][nt][lane], want)))
    print("fp8" if fp8 else "bf16", "tma" if tma else "rows", "S^T max err", err)
    # P := S (layout test); O^T += V^T P^T
    o = [[[[0.0]*4 for _ in range(32)] for _ in range(2)] for _ in range(8)]
    for ks in range(4):
        pb = []
        for nt in range(2):
            b0 = movt([(sc[ks][nt][l][0], sc[ks][nt][l][1]) for l in range(32)])
            b1 = movt([(sc[ks][nt][l][2], sc[ks][nt][l][3]) for l in range(32)])
            pb.append([(b0[l], b1[l]) for l in range(32)])
        va = [st + v_lane[l] + ks * 16 * kRs for l in range(32)]
        if fp8:
            for mt in range(0, 8, 2):
                regs = ldsm_x4(sm, [va[l] ^ (mt << 4) for l in range(32)], True, True)
                for t2 in range(2):
                    A = []
                    for lane in range(32):
                        r0 = regs[lane][2*t2]; r1 = regs[lane][2*t2+1]  # ((b0,b1),(b2,b3)) as loaded
                        def perm(r):  # __byte_perm(x, 0, 0x3120): bytes b0, b2, b1, b3
                            (b0, b1), (b2, b3) = r
                            return ((b0, b2), (b1, b3))
                        p0 = perm(r0); p1 = perm(r1)
                        a0 = cvt(p0[0]); a1 = cvt(p0[1]); a2 = cvt(p1[0]); a3 = cvt(p1[1])
                        A.append((a0, a1, a2, a3))
                    for nt in range(2):
                        mma(o[mt+t2][nt], A, pb[nt])
        else:
            for mt in range(8):
                regs = ldsm_x4(sm, [((va[l] ^ ((mt & 3) << 5)) + (mt >> 2) * kBox) if tma else (va[l] ^ (mt << 5))
                                    for l in range(32)], True)
                A = [tuple(regs[l]) for l in range(32)]
                for nt in range(2):
                    mma(o[mt][nt], A, pb[nt])
    O = S.T @ V  # [head][dim]
    out = np.full((16, 128), np.nan)
    for mt in range(8):
        for nt in range(2):
            if fp8:
                for lane in range(32):
                    g, cq = lane // 4, lane % 4
                    for c2 in range(2):
                        out[nt*8 + 2*cq + c2][mt*16 + 2*g] = o[mt][nt][lane][c2]
                        out[nt*8 + 2*cq + c2][mt*16 + 2*g + 1] = o[mt][nt][lane][2 + c2]
            else:
                for half in range(2):
                    y = movt([(o[mt][nt][l][2*half], o[mt][nt][l][2*half+1]) for l in range(32)])
                    for lane in range(32):
                        g, cq = lane // 4, lane % 4
                        out[nt*8 + g][mt*16 + half*8 + 2*cq] = y[lane][0]
                        out[nt*8 + g][mt*16 + half*8 + 2*cq + 1] = y[lane][1]
    print("fp8" if fp8 else "bf16", "tma" if tma else "rows", "O max err", np.nanmax(np.abs(out - O)), "unwritten", int(np.isnan(out).sum()))

for tma in (False, True):
    run(False, tma)
    run(True, tma)
