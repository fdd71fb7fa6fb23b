// The `m3rt check` rows of the lightning indexer: indexer_prefill (varlen, chunked prefill) and
// indexer_decode (decode_query_len 1, 8, 32 with padded requests).
// A selection is checked as a set (indexer_compare.h): the contract, the forced blocks, and the
// ranking against reference scores within error bounds — on the CPU against an fp64 oracle of the
// spec's formula (rel_tol 129 * 2^-24, the bound of a 128-term fp32 dot), on a GPU against the CPU
// reference's scores (rel_tol 2^-12: tensor-core sums). topk_out is poisoned with 0x7F bytes
// (0x7F7F7F7F is no valid id; 0xFF bytes would read as -1, a valid entry) and rows >= T must keep
// them. Every index-cache row no token may read holds NaN (0xFF bytes in bf16 and e4m3): pages no
// request uses, a request's rows at positions >= seq_len, and all rows of a request without query
// tokens; unused block_table entries hold garbage page ids. So a kernel that reads past the causal
// range, or through an entry it should not use, selects by NaN or fails to stay in bounds.
// Shared helpers: src/check/check_helpers.h.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "check/check_helpers.h"
#include "check/check_util.h"
#include "m3rt/lightning_indexer.h"
#include "ops/lightning_indexer/indexer_compare.h"
#include "ops/lightning_indexer/lightning_indexer.h"

namespace m3rt::detail {

namespace {

constexpr int kBs = kIndexBlockSize;
constexpr uint8_t kTopkPoison = 0x7F;
constexpr int64_t kExtraRows = 3;        // topk_out rows past T: must stay poisoned
constexpr double kCpuRelTol = 129 * 0x1p-24;  // > gamma_128: a 128-term fp32 dot vs the exact one
constexpr double kGpuRelTol = 0x1p-12;

struct IdxVariant {
  bool fp8;
  int heads;
  IndexerSelection sel;
  int dql;                    // decode_query_len; 0: prefill
  std::vector<int> seq_lens;
  std::vector<int> q_lens;    // prefill: query tokens of each request
  bool pdl = false;           // decode: IndexerDecodeArgs::enable_pdl
};

// Host inputs of one call.
struct IdxInputs {
  Tensor q, cache, cu, seq_lens, table;
  int64_t T = 0;
  int max_query_len = 0;
};


IdxInputs make_inputs(Rng& rng, const IdxVariant& v) {
  const int B = int(v.seq_lens.size()), H = v.heads;
  const int64_t esz = v.fp8 ? 1 : 2;
  const DType cdt = v.fp8 ? DType::kUInt8 : DType::kBFloat16;
  IdxInputs in;
  PagedBatch pb = make_paged_batch(rng, v.seq_lens, v.q_lens, v.dql);
  in.T = pb.T;
  in.max_query_len = pb.max_query_len;
  in.cache = Tensor::empty({pb.pages, kBs, 128}, cdt);
  in.cache.fill_bytes(0xFF);
  for (int b = 0; b < B; ++b) {
    // Rows some token may read: positions < seq_len, when the request has query tokens.
    if (pb.cu[size_t(b) + 1] == pb.cu[size_t(b)]) continue;
    for (int j = 0; j < pb.blocks[size_t(b)]; ++j) {
      const int rows = std::min(kBs, v.seq_lens[size_t(b)] - j * kBs);
      for (int64_t i = 0; i < int64_t(rows) * 128; ++i) {
        const uint16_t c = random_code(rng, v.fp8);
        const int64_t o = (int64_t(pb.page(b, j)) * kBs * 128 + i) * esz;
        if (v.fp8) in.cache.ptr<uint8_t>()[o] = uint8_t(c);
        else in.cache.ptr<uint16_t>()[o / 2] = c;
      }
    }
  }
  in.q = Tensor::empty({in.T, H, 128}, v.fp8 ? (v.dql ? DType::kFloat8E4M3 : DType::kUInt8) : DType::kBFloat16);
  for (int64_t i = 0; i < in.q.numel(); ++i) {
    const uint16_t c = random_code(rng, v.fp8);
    if (v.fp8) in.q.ptr<uint8_t>()[i] = uint8_t(c);
    else in.q.ptr<uint16_t>()[i] = c;
  }
  in.cu = pb.cu_seqlens_q;
  in.seq_lens = pb.seq_lens;
  in.table = pb.block_table;
  return in;
}

IndexerConfig variant_config(const IdxVariant& v, const IdxInputs& in) {
  IndexerConfig cfg;
  cfg.num_index_heads = v.heads;
  cfg.select = v.sel;
  cfg.index_cache_dtype = v.fp8 ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kBFloat16;
  cfg.max_prefill_tokens = v.dql ? 0 : in.T;
  cfg.max_decode_seqs = v.dql ? int(v.seq_lens.size()) : 0;
  cfg.max_decode_query_len = std::max(v.dql, 1);
  cfg.max_blocks_per_seq = int(in.table.view().shape[1]);
  return cfg;
}

// The call over the host inputs, for the comparison and the scores.
IndexerParams host_params(const IdxVariant& v, const IdxInputs& in) {
  return indexer_call_params(variant_config(v, in), in.q, in.cache, in.seq_lens, in.table, TensorView{},
                             in.cu, v.dql, in.max_query_len);
}

// The op on `dev` with poisoned output rows; returns them on the host.
Tensor run_indexer(const IdxVariant& v, const IdxInputs& in, Device dev) {
  LightningIndexer indexer(variant_config(v, in), dev);
  Tensor q = on(in.q, dev), cache = on(in.cache, dev), cu = on(in.cu, dev), lens = on(in.seq_lens, dev),
         table = on(in.table, dev);
  Tensor out = Tensor::empty({in.T + kExtraRows, v.heads, v.sel.topk}, DType::kInt32, dev);
  out.fill_bytes(kTopkPoison);
  if (v.dql) {
    indexer.decode({.index_q = q, .index_cache = cache, .seq_lens = lens, .block_table = table,
                    .decode_query_len = v.dql, .topk_out = out, .enable_pdl = v.pdl});
  } else {
    indexer.prefill({.index_q = q, .index_cache = cache, .cu_seqlens_q = cu, .seq_lens = lens,
                     .block_table = table, .max_query_len = in.max_query_len, .topk_out = out});
  }
  return to_host(out);
}

// One table row for a set comparison: worst = failed (token, head) rows, tolerance 0 rows.
void add_set_row(CheckContext& c, const std::string& output, const IndexerCompareResult& r) {
  CheckRow row;
  row.op = c.op;
  row.variant = c.variant;
  row.device = c.device.str();
  row.output = output;
  row.worst = double(r.rows_failed);
  row.unit = "rows";
  row.where = "of " + std::to_string(r.rows_checked) + " rows";
  row.tolerance = 0;
  row.checked = r.rows_checked;
  row.pass = r.pass();
  if (!row.pass) {
    std::string f = r.first_failures;
    std::replace(f.begin(), f.end(), '\n', ';');
    row.message = r.summary() + ": " + f;
  }
  c.rows.push_back(row);
}

void check_indexer_variant(CheckContext& c, const IdxVariant& v) {
  const IndexerSelection& s = v.sel;
  IdxInputs in = make_inputs(c.rng, v);
  c.variant = std::string(v.fp8 ? "fp8" : "bf16") + " H" + std::to_string(v.heads) + " k" +
              std::to_string(s.topk) + "/i" + std::to_string(s.init_blocks) + "/l" +
              std::to_string(s.local_blocks) + (v.dql ? " dql" + std::to_string(v.dql) : "") +
              " B" + std::to_string(v.seq_lens.size()) + " T" + std::to_string(in.T) + (v.pdl ? " pdl" : "");
  const Tensor got = run_indexer(v, in, c.device);
  const IndexerParams p = host_params(v, in);
  const int64_t row_stride = int64_t(v.heads) * s.topk;
  IndexerCompareResult r;
  if (c.device.is_cuda()) {
    r = compare_indexer_topk(p, got.ptr<int32_t>(), row_stride, indexer_ref_row_scores(p), kGpuRelTol);
  } else {
    r = compare_indexer_topk(p, got.ptr<int32_t>(), row_stride, indexer_oracle_row_scores(p), kCpuRelTol);
  }
  add_set_row(c, "topk_out (sets)", r);
  Tensor poison = Tensor::empty({in.T + kExtraRows, v.heads, s.topk}, DType::kInt32);
  poison.fill_bytes(kTopkPoison);
  add_row(c, "topk_out[T:] untouched", got.view().narrowed(0, in.T, kExtraRows),
          poison.view().narrowed(0, in.T, kExtraRows), DType::kInt32, 0);
}

const IndexerSelection kM3{16, 0, 1};       // MiniMax-M3: top 16, the local block forced
const IndexerSelection kInit2Local2{8, 2, 2};

}  // namespace

void check_indexer_prefill(CheckContext& c) {
  // Requests: a full prefill, a chunked prefill (seq_len > query length: 2300 tokens of context),
  // one just past a block edge, and one without query tokens (none of its rows may be read).
  check_indexer_variant(c, {false, 4, kM3, 0, {300, 2400, 130, 700}, {300, 100, 130, 0}});
  check_indexer_variant(c, {true, 4, kM3, 0, {2200, 129, 256}, {90, 129, 200}});
  check_indexer_variant(c, {true, 2, kInit2Local2, 0, {1500, 0, 400}, {150, 0, 400}});
  // Head counts whose tiles leave query rows unused (3: 42 tokens, 126 of 128 rows) or hold few
  // tokens (16: 8 tokens a tile, every page of a short request diagonal).
  check_indexer_variant(c, {true, 3, kM3, 0, {700, 260}, {700, 60}});
  check_indexer_variant(c, {true, 16, kInit2Local2, 0, {390}, {390}});
  // Block tables of >= 128 pages (the Hopper kernel's 16-page chunks): chunked prefills deep in
  // long contexts.
  check_indexer_variant(c, {false, 4, kM3, 0, {16500, 300}, {40, 300}});
  check_indexer_variant(c, {true, 2, kM3, 0, {20000}, {24}});
}

void check_indexer_decode(CheckContext& c) {
  // seq_len 0 pads (all -1); 100 < 128; 20 < dql for dql 32 (leading rows -1).
  const std::vector<int> lens = {0, 100, 3000, 1500, 129};
  check_indexer_variant(c, {false, 4, kM3, 1, lens, {}});
  check_indexer_variant(c, {true, 4, kM3, 1, lens, {}, true});  // launched with PDL (Hopper)
  check_indexer_variant(c, {true, 4, kM3, 8, lens, {}});
  check_indexer_variant(c, {false, 4, kInit2Local2, 32, {2100, 0, 20, 1400}, {}});
  check_indexer_variant(c, {true, 2, kInit2Local2, 8, {1300, 7, 0, 2600}, {}});
  // Long rows: 256 and 257 blocks (one and two 256-block chunks of the selection), 313, and 1094
  // (past 1024: the long-row selection).
  check_indexer_variant(c, {false, 4, kM3, 1, {32768, 32769, 40000, 140000}, {}});
  check_indexer_variant(c, {true, 2, kInit2Local2, 2, {131072, 70000, 32897}, {}});
}

}  // namespace m3rt::detail
