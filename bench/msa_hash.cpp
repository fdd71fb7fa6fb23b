// m3rt_msa_hash: hashes (64-bit FNV-1a) of the output and LSE bits of fixed MSA calls through the
// public API (m3rt::msa_prefill, m3rt::MsaDecodePlan) on the first GPU, one line a call. Inputs are
// pseudo-random from a fixed seed, so two builds of the library whose kernels compute the same sums
// in the same order print the same lines: the check that a kernel change meant to be exact (a
// reordered loop, a new pipeline, bookkeeping) is bit-identical, beside `m3rt check`'s tolerances.
// Run it once a library (LD_LIBRARY_PATH picks which libm3rt.so.0) and diff the outputs.
// Calls: M3's TP1 heads (Hq 64, Hkv 4, topk 16): e4m3 prefill with the P residue and without
// (p_residue false), bf16 prefill, e4m3 verify (dql 8, 32 requests) both ways, bf16 verify, and
// dql-1 decode of 1 and 8 requests in bf16 and e4m3 (split grids, merged in a cluster on Hopper);
// ids include -1 entries and adjacent rows share most of their pages.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <vector>

#include "m3rt/m3rt.h"

namespace {

using m3rt::DType;
using m3rt::Tensor;

struct Rng {  // xorshift64
  uint64_t s = 88172645463325252ull;
  uint32_t next() {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    return uint32_t(s >> 11);
  }
  float uniform() { return float(next() & 0xffffff) / float(1 << 24) * 2.f - 1.f; }  // [-1, 1)
};

uint64_t fnv1a(const void* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<const unsigned char*>(p)[i]) * 1099511628211ull;
  return h;
}

struct Case {
  bool fp8, p_residue;
  int requests, query_len, context, dql;  // dql 0: prefill (query_len tokens, 11 fewer a request)
};

void run_case(const Case& c, Rng& rng) {
  constexpr int kHq = 64, kHkv = 4, kTopk = 16, kDim = 128;
  const int max_blocks = (c.context + 127) / 128;
  std::vector<int> seq(c.requests), qlen(c.requests);
  int64_t tokens = 0;
  int max_q = 0;
  for (int b = 0; b < c.requests; ++b) {
    seq[b] = c.context - 37 * b, qlen[b] = c.dql ? c.dql : c.query_len - 11 * b;
    tokens += qlen[b], max_q = std::max(max_q, qlen[b]);
  }
  const int64_t blocks = int64_t(c.requests) * max_blocks + 3;
  Tensor q = Tensor::empty({tokens, kHq, kDim}, DType::kBFloat16);
  for (int64_t i = 0; i < q.numel(); ++i) q.ptr<uint16_t>()[i] = m3rt::float_to_bf16(rng.uniform());
  Tensor cache = Tensor::empty({blocks, kHkv, 128, 256}, c.fp8 ? DType::kUInt8 : DType::kBFloat16);
  for (int64_t i = 0; i < cache.numel(); ++i) {
    if (c.fp8) cache.ptr<uint8_t>()[i] = uint8_t(rng.next()) & 0xbf;  // |x| < 2^8, no NaN code
    else cache.ptr<uint16_t>()[i] = m3rt::float_to_bf16(rng.uniform());
  }
  Tensor table = Tensor::empty({c.requests, max_blocks}, DType::kInt32);
  for (int b = 0; b < c.requests; ++b)
    for (int j = 0; j < max_blocks; ++j)
      table.ptr<int32_t>()[b * max_blocks + j] = int32_t((int64_t(b) * max_blocks + j * 7) % blocks);
  Tensor topk = Tensor::empty({kHkv, tokens, kTopk}, DType::kInt32);
  int32_t* ids = topk.ptr<int32_t>();
  for (int h = 0; h < kHkv; ++h)
    for (int b = 0, t0 = 0; b < c.requests; t0 += qlen[b], ++b)
      for (int i = 0; i < qlen[b]; ++i) {
        const int visible = (seq[b] - qlen[b] + i) / 128 + 1;  // blocks the row's position sees
        int32_t* row = ids + (int64_t(h) * tokens + t0 + i) * kTopk;
        for (int k = 0; k < kTopk; ++k) {
          int id = k == 0 ? visible - 1 : k == 1 ? 0 : int(rng.next() % uint32_t(visible));
          if (rng.next() % 13 == 0) id = -1;
          if (i > 0 && k > 1 && rng.next() % 4 != 0) id = std::min(row[k - kTopk], visible - 1);  // the row above's
          row[k] = id;
        }
      }
  Tensor lens = Tensor::empty({c.requests}, DType::kInt32), cu = Tensor::empty({c.requests + 1}, DType::kInt32);
  cu.ptr<int32_t>()[0] = 0;
  for (int b = 0; b < c.requests; ++b)
    lens.ptr<int32_t>()[b] = seq[b], cu.ptr<int32_t>()[b + 1] = cu.ptr<int32_t>()[b] + qlen[b];
  Tensor k_scale = Tensor::empty({1}, DType::kFloat32), v_scale = Tensor::empty({1}, DType::kFloat32);
  k_scale.ptr<float>()[0] = 0.37f, v_scale.ptr<float>()[0] = 1.9f;

  const m3rt::Device gpu = m3rt::Device::cuda(0);
  const Tensor dq = q.to(gpu), dcache = cache.to(gpu), dtable = table.to(gpu), dtopk = topk.to(gpu);
  const Tensor dlens = lens.to(gpu), dcu = cu.to(gpu), dks = k_scale.to(gpu), dvs = v_scale.to(gpu);
  // The outputs poisoned (every byte 0xff: NaN in bf16 and fp32), so that an element a library does
  // not write hashes the same way in every run and differs from a written one.
  auto poisoned = [&](std::vector<int64_t> shape, DType dt) {
    Tensor h = Tensor::empty(std::move(shape), dt);
    std::memset(h.data(), 0xff, size_t(h.nbytes()));
    return h.to(gpu);
  };
  Tensor out = poisoned({tokens, kHq, kDim}, DType::kBFloat16);
  Tensor lse = poisoned({tokens, kHq}, DType::kFloat32);
  m3rt::MsaKvCache kv{dcache.view(), c.fp8 ? m3rt::KvCacheDtype::kFp8E4M3 : m3rt::KvCacheDtype::kBFloat16,
                      c.fp8 ? dks.view() : m3rt::TensorView{}, c.fp8 ? dvs.view() : m3rt::TensorView{}};
  constexpr float kScale = 0.0884f;
  if (c.dql == 0) {
    m3rt::MsaPrefillArgs a;
    a.q = dq, a.cache = kv, a.topk = dtopk, a.cu_seqlens_q = dcu, a.seq_lens = dlens, a.block_table = dtable;
    a.max_query_len = max_q, a.softmax_scale = kScale, a.out = out, a.lse = lse, a.p_residue = c.p_residue;
    m3rt::msa_prefill(a);
  } else {
    m3rt::MsaDecodePlan plan({.batch = c.requests, .decode_query_len = c.dql, .num_heads = kHq, .num_kv_heads = kHkv,
                              .topk = kTopk, .max_blocks = max_blocks, .kv_cache_dtype = kv.kv_cache_dtype},
                             gpu);
    m3rt::MsaDecodeArgs a;
    a.q = dq, a.cache = kv, a.topk = dtopk, a.seq_lens = dlens, a.block_table = dtable;
    a.softmax_scale = kScale, a.out = out, a.lse = lse, a.p_residue = c.p_residue;
    plan.run(a);
  }
  const Tensor ho = out.to(m3rt::Device::cpu()), hl = lse.to(m3rt::Device::cpu());
  std::printf("%s %-4s p_residue %d  requests %2d  tokens %5lld  out %016llx  lse %016llx\n",
              c.dql > 1 ? "verify " : c.dql ? "decode " : "prefill", c.fp8 ? "e4m3" : "bf16", int(c.p_residue), c.requests, (long long)tokens,
              (unsigned long long)fnv1a(ho.data(), size_t(ho.nbytes())),
              (unsigned long long)fnv1a(hl.data(), size_t(hl.nbytes())));
}

}  // namespace

int main() {
  try {
    if (m3rt::cuda_device_count() == 0) {
      std::fprintf(stderr, "m3rt_msa_hash: no CUDA device\n");
      return 1;
    }
    Rng rng;
    const Case cases[] = {{true, true, 1, 2048, 8192, 0}, {true, false, 2, 700, 5000, 0},
                          {false, true, 1, 1024, 4100, 0}, {true, true, 32, 0, 4000, 8},
                          {true, false, 32, 0, 2500, 8},   {false, true, 32, 0, 3000, 8},
                          {false, true, 1, 0, 30000, 1},   {true, true, 1, 0, 30000, 1},
                          {false, true, 8, 0, 20000, 1},   {true, true, 8, 0, 20000, 1}};
    for (const Case& c : cases) run_case(c, rng);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "m3rt_msa_hash: %s\n", e.what());
    return 1;
  }
}
