// The `m3rt check` rows of MSA sparse attention: msa_prefill (varlen, chunked prefill; groups 16,
// 4, 1, 8; topk 16 and 64; a 200,000-token context) and msa_decode (decode_query_len 1, 2, 5, 7, 8 and 32, groups 16, 8, 4, 2, 1, topk 16
// and 64, padded requests, non-causal windowed variants, batches of up to 50, block tables of
// 5000 and 30000 blocks a row).
// Inputs: q random bf16 in [-1, 1]; cache codes random; shuffled block tables; top-k lists made
// like the indexer's (unique ascending ids of visible blocks, the local block last, then -1) with
// -1 holes, repeated ids and ids past the visible blocks inserted in some rows. Every (page, KV head)
// slice no row uses holds NaN (0xFF bytes in bf16 and e4m3), and so does every row of a used page
// at a position >= seq_len; unused block_table entries hold garbage page ids. So a kernel that reads
// an unselected page, a skipped entry or a key past seq_len turns its row NaN. out and lse are
// poisoned (0xFF: NaN) before the call; every row must be written.
// On the CPU the op (the reference) is compared with the fp64 oracle (msa_oracle.h): out within
// 1 bf16 ulp of the oracle rounded once, or 1e-6 absolute; lse within 1e-5 relative. On a GPU the op
// is compared with the CPU reference: out within 3 bf16 ulps or 8e-4 absolute; lse within 2^-15
// relative. Relative lse errors are |got - want| / max(|want|, 1); -inf must match -inf.
// Shared helpers: src/check/check_helpers.h.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "check/check_helpers.h"
#include "check/check_util.h"
#include "check/compare.h"
#include "m3rt/msa_attention.h"
#include "ops/msa_attention/msa_oracle.h"

namespace m3rt::detail {

namespace {

constexpr int kBs = kMsaPageSize;
constexpr double kCpuUlps = 1, kCpuAbs = 1e-6, kCpuLseRel = 1e-5;
constexpr double kGpuUlps = 3, kGpuAbs = 8e-4, kGpuLseRel = 2.0 / 65536;
constexpr double kPpm = 1e-6;  // lse rows report relative errors in parts per million

struct MsaVariant {
  bool fp8;
  int hq, hkv, topk;
  int dql;                    // decode_query_len; 0: prefill
  std::vector<int> seq_lens;
  std::vector<int> q_lens;    // prefill: query tokens of each request
  MsaMask mask{};
  int table_width = 0;        // > 0: the block table widened with -1 columns to this many blocks
  bool zero_k_scale = false;  // fp8: k_scale 0 (every visible key weighs the same)
};

// Host inputs of one call; topk is the [Hkv, T, topk] view of the token-major buffer.
struct MsaInputs {
  Tensor q, cache, k_scale, v_scale, topk_buf, cu, seq_lens, table;
  TensorView topk;
  int64_t T = 0;
  int max_query_len = 0;
};


// The [Hkv, T, K] view of a token-major [T, Hkv, K] buffer (on any device).
TensorView head_major_view(const Tensor& buf) {
  const TensorView& b = buf.view();
  TensorView v = b;
  v.shape[0] = b.shape[1], v.shape[1] = b.shape[0];
  v.stride[0] = b.stride[1], v.stride[1] = b.stride[0];
  return v;
}

// An indexer-like list of row (t, g) with nb visible blocks, then (one row in three) a -1 hole, a
// repeated id or an id past the visible blocks inserted at a random place (the last entry drops
// out of a full list).
void make_list(Rng& rng, int nb, int K, int32_t* list) {
  const int k = std::min(K, nb);
  std::vector<int32_t> ids;
  if (k > 0) {
    std::vector<int32_t> rest(static_cast<size_t>(nb - 1));
    std::iota(rest.begin(), rest.end(), 0);
    std::shuffle(rest.begin(), rest.end(), rng.gen());
    ids.assign(rest.begin(), rest.begin() + (k - 1));
    std::sort(ids.begin(), ids.end());
    ids.push_back(nb - 1);  // the local block last
  }
  const int64_t kind = rng.integer(0, 5);
  if (kind < 3) {
    const int32_t extra = kind == 0 ? -1 : kind == 1 && k > 0 ? ids[size_t(rng.integer(0, k - 1))]
                                                             : nb + int32_t(rng.integer(0, 2));
    ids.insert(ids.begin() + rng.integer(0, int64_t(ids.size())), extra);
  }
  ids.resize(size_t(K), -1);
  std::copy(ids.begin(), ids.end(), list);
}

// n decode lengths in [0, max_len], every 13th a pad (0).
std::vector<int> spread_lens(int n, int max_len) {
  std::vector<int> lens(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) lens[size_t(i)] = i % 13 == 0 ? 0 : 1 + (i * 977) % max_len;
  return lens;
}

MsaInputs make_inputs(Rng& rng, const MsaVariant& v) {
  const int B = int(v.seq_lens.size()), K = v.topk, Hkv = v.hkv;
  MsaInputs in;
  const PagedBatch pb = make_paged_batch(rng, v.seq_lens, v.q_lens, v.dql);
  const std::vector<int32_t>& cu = pb.cu;
  const int pages = pb.pages;
  in.T = pb.T;
  in.max_query_len = pb.max_query_len;
  in.table = pb.block_table;
  if (v.table_width > in.table.view().shape[1]) {
    const int64_t w = in.table.view().shape[1];
    Tensor wide = Tensor::empty({B, v.table_width}, DType::kInt32);
    for (int b = 0; b < B; ++b)
      for (int j = 0; j < v.table_width; ++j)
        wide.ptr<int32_t>()[int64_t(b) * v.table_width + j] = j < w ? in.table.ptr<int32_t>()[b * w + j] : -1;
    in.table = wide;
  }
  // Top-k lists, and the (page, KV head) slices some row uses.
  in.topk_buf = Tensor::empty({in.T, Hkv, K}, DType::kInt32);
  std::vector<char> slice_used(size_t(pages) * size_t(Hkv), 0);
  for (int b = 0; b < B; ++b)
    for (int64_t t = cu[size_t(b)]; t < cu[size_t(b) + 1]; ++t) {
      const int64_t len = v.seq_lens[size_t(b)];
      const int64_t pos = len - (cu[size_t(b) + 1] - cu[size_t(b)]) + (t - cu[size_t(b)]);
      const int64_t hi = v.mask.causal ? std::min(pos + 1, len) : len;
      const int nb = hi > 0 ? int((hi + kBs - 1) / kBs) : 0;
      for (int g = 0; g < Hkv; ++g) {
        int32_t* list = in.topk_buf.ptr<int32_t>() + (t * Hkv + g) * K;
        make_list(rng, nb, K, list);
        for (int i = 0; i < K; ++i)
          if (list[i] >= 0 && list[i] < nb)
            slice_used[size_t(pb.page(b, list[i])) * Hkv + g] = 1;
      }
    }
  in.topk = head_major_view(in.topk_buf);
  // The cache: NaN except the rows < seq_len of used slices.
  const int64_t esz = v.fp8 ? 1 : 2;
  in.cache = Tensor::empty({pages, Hkv, kBs, 256}, v.fp8 ? DType::kUInt8 : DType::kBFloat16);
  in.cache.fill_bytes(0xFF);
  for (int b = 0; b < B; ++b)
    for (int j = 0; j < pb.blocks[size_t(b)]; ++j) {
      const int64_t page = pb.page(b, j);
      const int rows = std::min(kBs, v.seq_lens[size_t(b)] - j * kBs);
      for (int g = 0; g < Hkv; ++g) {
        if (!slice_used[size_t(page) * Hkv + g]) continue;
        for (int64_t i = 0; i < int64_t(rows) * 256; ++i) {
          const uint16_t c = random_code(rng, v.fp8);
          const int64_t o = ((page * Hkv + g) * kBs * 256 + i) * esz;
          if (v.fp8) in.cache.ptr<uint8_t>()[o] = uint8_t(c);
          else in.cache.ptr<uint16_t>()[o / 2] = c;
        }
      }
    }
  in.q = random_half({in.T, v.hq, 128}, DType::kBFloat16, rng, -1.f, 1.f);
  in.k_scale = scalar_f32(v.fp8 ? (v.zero_k_scale ? 0.f : 0.7f) : 1.f);
  in.v_scale = scalar_f32(v.fp8 ? 1.3f : 1.f);
  in.cu = pb.cu_seqlens_q;
  in.seq_lens = pb.seq_lens;
  return in;
}

float softmax_scale() { return 1.f / std::sqrt(128.f); }

KvCacheDtype cache_dtype(const MsaVariant& v) {
  return v.fp8 ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kBFloat16;
}

// The op on `dev` with out and lse poisoned; returns them on the host.
std::pair<Tensor, Tensor> run_msa(const MsaVariant& v, const MsaInputs& in, Device dev, bool p_residue = true) {
  Tensor q = on(in.q, dev), cache = on(in.cache, dev), ks = on(in.k_scale, dev), vs = on(in.v_scale, dev),
         topk = on(in.topk_buf, dev), cu = on(in.cu, dev), lens = on(in.seq_lens, dev),
         table = on(in.table, dev);
  Tensor out = poisoned({in.T, v.hq, 128}, DType::kBFloat16, dev);
  Tensor lse = poisoned({in.T, v.hq}, DType::kFloat32, dev);
  const MsaKvCache c{cache, cache_dtype(v), ks, vs};
  if (v.dql) {
    MsaDecodePlan plan({.batch = int(v.seq_lens.size()), .decode_query_len = v.dql, .num_heads = v.hq,
                        .num_kv_heads = v.hkv, .topk = v.topk, .max_blocks = int(in.table.view().shape[1]),
                        .kv_cache_dtype = cache_dtype(v)},
                       dev);
    plan.run({.q = q, .cache = c, .topk = head_major_view(topk), .seq_lens = lens, .block_table = table,
              .softmax_scale = softmax_scale(), .mask = v.mask, .out = out, .lse = lse, .p_residue = p_residue});
  } else {
    msa_prefill({.q = q, .cache = c, .topk = head_major_view(topk), .cu_seqlens_q = cu, .seq_lens = lens,
                 .block_table = table, .max_query_len = in.max_query_len, .softmax_scale = softmax_scale(),
                 .mask = v.mask, .out = out, .lse = lse, .p_residue = p_residue});
  }
  return {to_host(out), to_host(lse)};
}

std::string num(double x) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.9g", x);
  return buf;
}

// add_row with the absolute tolerance in the unit printed as %g (add_row keeps 7 characters of a
// fixed-point number, which shows 1e-6 as 0.00000).
void add_out_row(CheckContext& c, const Tensor& got, const Tensor& want, double ulps, double abs_tol) {
  add_row(c, "out", got, want, DType::kBFloat16, ulps, abs_tol);
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", abs_tol);
  c.rows.back().unit = std::string(code_unit(DType::kBFloat16)) + " or " + buf + " abs";
}

// One check row of `n` elements scored one by one: score(i) = {error in the row's unit, whether it
// is out of tolerance, got, want}; where(i) names the element. The row reports the worst error and
// the first five failures.
struct ElementScore {
  double err;
  bool failed;
  double got, want;
};
template <class Score, class Where>
void add_scored_row(CheckContext& c, std::string variant, const char* output, const char* unit, double tolerance,
                    int64_t n, Score&& score, Where&& where) {
  CheckRow row;
  row.op = c.op;
  row.variant = std::move(variant);
  row.device = c.device.str();
  row.output = output;
  row.unit = unit;
  row.tolerance = tolerance;
  int64_t failed = 0;
  std::string first;
  for (int64_t i = 0; i < n; ++i) {
    const ElementScore e = score(i);
    ++row.checked;
    if (e.err > row.worst || row.where.empty()) row.worst = e.err, row.where = where(i);
    if (e.failed && ++failed <= 5) first += where(i) + " got " + num(e.got) + " want " + num(e.want) + "; ";
  }
  row.pass = failed == 0;
  if (!row.pass)
    row.message = std::to_string(failed) + " of " + std::to_string(row.checked) +
                  " elements out of tolerance: " + first;
  c.rows.push_back(row);
}

// One row for lse ([T, Hq] fp32, host) against `want`: relative error |got - want| / max(|want|, 1)
// in ppm; -inf must match -inf exactly, NaN never passes.
void add_lse_row(CheckContext& c, const Tensor& got, const std::vector<double>& want, double rel_tol) {
  const int64_t H = got.view().shape[1];
  add_scored_row(
      c, c.variant, "lse", "rel ppm", rel_tol / kPpm, got.numel(),
      [&](int64_t i) {
        const double g = got.ptr<float>()[i], w = want[size_t(i)];
        double err = 0;
        if (std::isinf(w) || std::isinf(g)) err = g == w ? 0 : INFINITY;
        else err = std::isnan(g) || std::isnan(w) ? INFINITY : std::fabs(g - w) / std::max(std::fabs(w), 1.0);
        return ElementScore{err / kPpm, err > rel_tol, g, w};
      },
      [&](int64_t i) {
        std::string where = "[";  // appended, not "[" + ...: GCC 12 warns falsely there (bug 105329)
        where += std::to_string(i / H) + ", " + std::to_string(i % H) + "]";
        return where;
      });
}

// The output with P rounded once (p_residue false) against the reference `want`: element i may
// differ by the default GPU tolerance (3 bf16 ulps of want or 8e-4) plus P's rounding bound
// u * abs_out[i] (msa_oracle: sum_n p_n |v_n| / sum_n p_n; u = 2^-8 for bf16 P, 2^-11 for the f16 P
// of an fp8 cache). The row reports |got - want| in percent of that allowance (tolerance 100).
void add_p16_out_row(CheckContext& c, const Tensor& got, const Tensor& want, const std::vector<double>& abs_out,
                     bool fp8) {
  const double u = fp8 ? 0x1p-11 : 0x1p-8;
  const int64_t H = got.view().shape[1];
  add_scored_row(
      c, c.variant + " p16", "out", "% of bound", 100, got.numel(),
      [&](int64_t i) {
        const double g = bf16_to_float(got.ptr<uint16_t>()[i]), w = bf16_to_float(want.ptr<uint16_t>()[i]);
        const double ulp = w == 0 ? 0 : std::ldexp(1.0, std::ilogb(w) - 7);
        const double allowed = std::max(kGpuUlps * ulp, kGpuAbs) + u * abs_out[size_t(i)];
        const double ratio = std::isnan(g) || std::isnan(w) ? INFINITY : 100 * std::fabs(g - w) / allowed;
        return ElementScore{ratio, !(ratio <= 100), g, w};
      },
      [&](int64_t i) {
        std::string where = "[";
        where += std::to_string(i / (H * 128)) + ", " + std::to_string(i / 128 % H) + ", " + std::to_string(i % 128) + "]";
        return where;
      });
}

void check_msa_variant(CheckContext& c, const MsaVariant& v) {
  MsaInputs in = make_inputs(c.rng, v);
  c.variant = std::string(v.fp8 ? "fp8" : "bf16") + " Hq" + std::to_string(v.hq) + "/Hkv" +
              std::to_string(v.hkv) + " k" + std::to_string(v.topk) +
              (v.dql ? " dql" + std::to_string(v.dql) : "") + " B" + std::to_string(v.seq_lens.size()) +
              " T" + std::to_string(in.T) + (v.mask.causal ? "" : " noncausal") +
              (v.mask.window_left ? " w" + std::to_string(v.mask.window_left) : "") +
              (v.table_width ? " table" + std::to_string(v.table_width) : "") + (v.zero_k_scale ? " k_scale0" : "");
  const auto [out, lse] = run_msa(v, in, c.device);
  auto oracle = [&] {
    return msa_oracle(msa_call_params(in.q, {in.cache, cache_dtype(v), in.k_scale, in.v_scale}, in.topk,
                                      v.dql ? TensorView{} : in.cu.view(), in.seq_lens, in.table, v.dql, 0,
                                      softmax_scale(), v.mask));
  };
  if (c.device.is_cuda()) {
    const auto [ref_out, ref_lse] = run_msa(v, in, Device::cpu());
    add_out_row(c, out, ref_out, kGpuUlps, kGpuAbs);
    add_lse_row(c, lse, std::vector<double>(ref_lse.ptr<float>(), ref_lse.ptr<float>() + ref_lse.numel()),
                kGpuLseRel);
    // Groups of more than 64 rows (Hopper's wgmma loop, where p_residue = false takes effect): the
    // same call with P rounded once.
    const int G = v.hq / v.hkv;
    if (msa_group_rows(G, msa_group_tokens(G, v.dql)) > 64) {
      const Tensor p16_out = run_msa(v, in, c.device, false).first;
      add_p16_out_row(c, p16_out, ref_out, oracle().abs_out, v.fp8);
    }
    return;
  }
  const MsaOracle o = oracle();
  Tensor want = Tensor::empty({in.T, v.hq, 128}, DType::kBFloat16);
  for (int64_t i = 0; i < want.numel(); ++i) want.ptr<uint16_t>()[i] = msa_oracle_bf16(o.out[size_t(i)]);
  add_out_row(c, out, want, kCpuUlps, kCpuAbs);
  add_lse_row(c, lse, o.lse, kCpuLseRel);
}

}  // namespace

void check_msa_prefill(CheckContext& c) {
  // Two requests each: a chunked prefill (seq_len > query length) and a full one.
  check_msa_variant(c, {false, 16, 1, 16, 0, {2000, 130}, {24, 130}});
  check_msa_variant(c, {true, 16, 4, 16, 0, {1100, 260}, {32, 150}});
  // Groups 1 and 8 (GPU row groups of 32 and 16 tokens).
  check_msa_variant(c, {false, 4, 4, 8, 0, {700, 300}, {200, 40}});
  check_msa_variant(c, {true, 16, 2, 16, 0, {900}, {77}});
  // Group 8 with 16-token GPU row groups (128 rows: the wgmma loop on Hopper), one group partial.
  check_msa_variant(c, {false, 16, 2, 16, 0, {1500, 77}, {300, 77}});
  // M3's group 16 with a bf16 cache (the per-token tile; the 64-row wgmma tile under
  // M3RT_MSA_TOKEN_TILE=0): non-causal, a window, a partial last row group, a request shorter than
  // a page.
  check_msa_variant(c, {false, 64, 4, 16, 0, {1400, 90}, {45, 90}, {.causal = false, .window_left = 700}});
  // e4m3 at group 16 (the per-token tile's f16 path), causal; topk 64 over every block of the first
  // request (a union of up to 8 x 64 entries).
  check_msa_variant(c, {true, 64, 4, 16, 0, {1300, 200}, {70, 200}});
  check_msa_variant(c, {true, 64, 4, 64, 0, {3000, 150}, {40, 150}});
  // A 200,000-token context (1,563 blocks: more than the per-token tile's prologue holds in
  // registers, 4 table entries a thread), its last 8 tokens.
  check_msa_variant(c, {true, 16, 1, 16, 0, {200000}, {8}});
  // k_scale 0 (device data, so no host check; the reference weighs every visible key the same):
  // the per-token tile scales the scores before its mask and max there.
  check_msa_variant(c, {true, 64, 4, 16, 0, {700, 150}, {40, 150}, {}, 0, true});
}

void check_msa_decode(CheckContext& c) {
  // seq_len 0 pads (out 0, lse -inf); 100, 90, 60 < 128; 5 < dql 8 (leading rows empty when causal).
  check_msa_variant(c, {false, 16, 1, 16, 1, {0, 100, 3000, 1500, 129}, {}});
  check_msa_variant(c, {true, 16, 1, 16, 8, {2300, 0, 90, 700}, {}});
  check_msa_variant(c, {false, 16, 4, 16, 8, {1700, 60, 0, 2600}, {}});
  check_msa_variant(c, {true, 8, 2, 16, 8, {1000, 5, 400, 0}, {}, {.causal = false, .window_left = 200}});
  // Groups 8, 2 and 1; dql 32 (two GPU row groups per request), 2 and 1; topk 64.
  check_msa_variant(c, {true, 16, 2, 16, 32, {1300, 40}, {}});
  check_msa_variant(c, {false, 4, 2, 64, 2, {3000, 70, 9000}, {}});
  check_msa_variant(c, {false, 2, 2, 16, 1, {500, 260}, {}});
  // dql 1 (msa_decode1_kernel on the GPU): e4m3 at group 16 with pads and a one-key request; group
  // 8, topk 64, non-causal with a window (bf16 and e4m3); batches whose (request, KV head) pairs split 2 ways
  // (e4m3, 160 pairs) and not at all (400 pairs) on an H200.
  check_msa_variant(c, {true, 16, 1, 16, 1, {0, 700, 1, 5000, 129}, {}});
  check_msa_variant(c, {false, 32, 4, 64, 1, {3000, 1, 9000, 200}, {}, {.causal = false, .window_left = 300}});
  check_msa_variant(c, {true, 32, 4, 64, 1, {3000, 1, 9000, 200}, {}, {.causal = false, .window_left = 300}});
  check_msa_variant(c, {true, 64, 4, 16, 1, spread_lens(40, 800), {}});
  check_msa_variant(c, {false, 32, 8, 16, 1, spread_lens(50, 1500), {}});
  // e4m3 batch 8: 9 splits merged in one cluster (on an H200).
  check_msa_variant(c, {true, 64, 4, 16, 1, spread_lens(8, 2000), {}});
  // Mixed grids on an H200 (bf16: one round of whole pairs and 60 in halves; e4m3: two rounds and 56
  // in halves, short requests leaving some halves without keys).
  check_msa_variant(c, {false, 64, 4, 16, 1, spread_lens(48, 700), {}});
  check_msa_variant(c, {true, 64, 4, 16, 1, spread_lens(80, 400), {}});
  // Wide block tables (5000 and 30000 blocks a row, most of them -1).
  check_msa_variant(c, {false, 16, 1, 16, 1, {700, 2000, 0}, {}, {}, 5000});
  check_msa_variant(c, {true, 16, 1, 16, 1, {900, 129}, {}, {}, 30000});
  // Verify at M3's group 16: 128-row groups (dql 8) and 80-row groups (dql 5, a partly filled
  // second warpgroup on Hopper), with pads and lengths below dql.
  check_msa_variant(c, {false, 32, 2, 16, 8, {1700, 60, 0, 2600}, {}});
  check_msa_variant(c, {false, 16, 1, 16, 5, {900, 3, 300}, {}});
  // Verify at M3's TP1 heads, 80 (request, KV head) pairs: one split (on an H200), so the per-token
  // tile (with M3RT_MSA_TOKEN_TILE=0 the unsplit copy-engine loop, e4m3 with its producer
  // warpgroup); most requests end in a partial chunk.
  check_msa_variant(c, {true, 64, 4, 16, 8, spread_lens(20, 3000), {}});
  check_msa_variant(c, {false, 64, 4, 16, 8, spread_lens(20, 3000), {}});
  // The drafter's shape: 7 block rows x 16 heads (112-row groups), non-causal, window 4096, 64
  // listed blocks of 65; batch 2 splits each group over many CTAs (on Hopper: one cluster that
  // merges through DSMEM).
  check_msa_variant(c, {false, 64, 4, 64, 7, {8199, 1000}, {}, {.causal = false, .window_left = 4096}});
}

}  // namespace m3rt::detail
