// The DSpark draft config reader (include/m3rt/dspark_config.h): the real MiniMax-M3.1 checkpoint's
// values (dspark.md §1, §6), the alternate field names, conflicting duplicates, each missing
// required field, wrong JSON kinds, every validation rule raising an error that names the document
// and the field, dspark_config_json round trips, and reading from a file.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "core/json.h"
#include "m3rt/dspark_checkpoint.h"
#include "m3rt/dspark_config.h"
#include "m3rt/error.h"
#include "core/temp_dir.h"
#include "source_dir.h"

namespace {

using namespace m3rt;
using detail::Json;
namespace fs = std::filesystem;

// The M3.1 draft checkpoint's config.json as vLLM reads it: the dspark_* names, mxfp8 weights and
// fields the drafter does not use. max_position_embeddings is the target's (msa.md), which the
// draft config copies.
constexpr const char* kM31 = R"({
  "architectures": ["DSparkMiniMaxDraftModel"],
  "model_type": "minimax_m3",
  "num_hidden_layers": 5,
  "hidden_size": 6144,
  "num_attention_heads": 64,
  "num_key_value_heads": 4,
  "head_dim": 128,
  "dspark_ffn_hidden_size": 12288,
  "dspark_use_dense_ffn": true,
  "moe_layer_freq": [0, 0, 0, 0, 0],
  "sparse_attention_config": null,
  "vocab_size": 200064,
  "dspark_block_size": 7,
  "dspark_noise_token_id": 200058,
  "dspark_target_layer_ids": [3, 17, 31, 45, 59],
  "dspark_markov_rank": 256,
  "dspark_markov_head_type": "vanilla",
  "enable_confidence_head": true,
  "confidence_head_with_markov": true,
  "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "sliding_attention",
                  "sliding_attention"],
  "sliding_window": 4096,
  "use_gemma_norm": true,
  "dspark_hybrid_context_fusion": false,
  "dspark_config": {"hybrid_context_fusion": false},
  "sample_from_anchor": true,
  "dspark_bonus_anchor": false,
  "hidden_act": "swigluoai",
  "swiglu_alpha": 1.702,
  "swiglu_limit": 7.0,
  "rms_norm_eps": 1e-06,
  "rope_theta": 5000000.0,
  "partial_rotary_factor": 0.5,
  "max_position_embeddings": 1048576,
  "torch_dtype": "bfloat16",
  "quantization_config": {"quant_method": "mxfp8", "weight_block_size": [1, 32]}
})";

// A config.json as an ordered list of members (name, JSON text) that tests edit.
class Doc {
 public:
  explicit Doc(const char* json) {
    const Json doc = detail::parse_json(json, "doc");
    for (const auto& [name, value] : doc.as_object("doc")) members_.emplace_back(name, value.dump());
  }
  // Replaces member `name` (in place) or appends it.
  Doc& set(const std::string& name, const std::string& json) {
    for (auto& m : members_)
      if (m.first == name) {
        m.second = json;
        return *this;
      }
    members_.emplace_back(name, json);
    return *this;
  }
  Doc& erase(const std::string& name) {
    std::erase_if(members_, [&](const auto& m) { return m.first == name; });
    return *this;
  }
  std::string text() const {
    std::string s = "{";
    for (const auto& m : members_) {
      if (s.size() > 1) s += ',';
      s.append("\"").append(m.first).append("\":").append(m.second);
    }
    return s + "}";
  }

 private:
  std::vector<std::pair<std::string, std::string>> members_;
};

Doc m31() { return Doc(kM31); }

DsparkConfig parse(const Doc& d) { return parse_dspark_config(d.text(), "cfg.json"); }

// The message of the m3rt::Error that parsing `d` raises ("" and a test failure when it parses).
std::string error_of(const Doc& d) {
  try {
    parse(d);
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no m3rt::Error for " << d.text();
  return "";
}

// Parsing `d` fails with a message naming the document and containing every fragment.
void expect_error(const Doc& d, const std::vector<std::string>& fragments) {
  const std::string msg = error_of(d);
  EXPECT_EQ(msg.rfind("cfg.json: ", 0), 0u) << msg;
  for (const std::string& f : fragments)
    EXPECT_NE(msg.find(f), std::string::npos) << "'" << f << "' not in: " << msg;
}

void expect_same(const DsparkConfig& a, const DsparkConfig& b) {
  EXPECT_EQ(a.num_layers, b.num_layers);
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.num_heads, b.num_heads);
  EXPECT_EQ(a.num_kv_heads, b.num_kv_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.ffn_size, b.ffn_size);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.block_size, b.block_size);
  EXPECT_EQ(a.mask_token_id, b.mask_token_id);
  EXPECT_EQ(a.target_layer_ids, b.target_layer_ids);
  EXPECT_EQ(a.markov_rank, b.markov_rank);
  EXPECT_EQ(a.markov_head_type, b.markov_head_type);
  EXPECT_EQ(a.confidence_head, b.confidence_head);
  EXPECT_EQ(a.confidence_with_markov, b.confidence_with_markov);
  EXPECT_EQ(a.sliding_window, b.sliding_window);
  EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);  // exact: floats must round-trip bit for bit
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.rotary_dim, b.rotary_dim);
  EXPECT_EQ(a.swiglu_alpha, b.swiglu_alpha);
  EXPECT_EQ(a.swiglu_beta, b.swiglu_beta);
  EXPECT_EQ(a.swiglu_limit, b.swiglu_limit);
  EXPECT_EQ(a.max_position_embeddings, b.max_position_embeddings);
  EXPECT_EQ(a.quant, b.quant);
}

// A small valid config (bf16, defaults wherever the reader has one).
DsparkConfig tiny() {
  DsparkConfig c = tiny_dspark_config();
  c.confidence_head = c.confidence_with_markov = false;
  c.sliding_window = 0;
  c.markov_rank = 16;
  c.rms_norm_eps = 1e-5f;
  c.rope_theta = 10000;
  c.rotary_dim = 32;
  c.max_position_embeddings = 4096;
  return c;
}

TEST(DsparkConfig, ParsesTheRealM31Config) {
  const DsparkConfig c = parse_dspark_config(kM31, "m31/config.json");
  EXPECT_EQ(c.num_layers, 5);
  EXPECT_EQ(c.hidden_size, 6144);
  EXPECT_EQ(c.num_heads, 64);
  EXPECT_EQ(c.num_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.ffn_size, 12288);
  EXPECT_EQ(c.vocab_size, 200064);
  EXPECT_EQ(c.block_size, 7);
  EXPECT_EQ(c.mask_token_id, 200058);
  EXPECT_EQ(c.target_layer_ids, (std::vector<int>{3, 17, 31, 45, 59}));
  EXPECT_EQ(c.markov_rank, 256);
  EXPECT_EQ(c.markov_head_type, "vanilla");
  EXPECT_TRUE(c.confidence_head);
  EXPECT_TRUE(c.confidence_with_markov);
  EXPECT_EQ(c.sliding_window, 4096);
  EXPECT_EQ(c.rms_norm_eps, 1e-6f);
  EXPECT_EQ(c.rope_theta, 5e6);
  EXPECT_EQ(c.rotary_dim, 64);
  EXPECT_EQ(c.swiglu_alpha, 1.702f);
  EXPECT_EQ(c.swiglu_beta, 1.0f);  // absent from the document: the default
  EXPECT_EQ(c.swiglu_limit, 7.0f);
  EXPECT_EQ(c.max_position_embeddings, 1048576);
  EXPECT_EQ(c.quant, DsparkQuant::kMxfp8);
}

TEST(DsparkConfig, DefaultsOfOptionalFields) {
  Doc d = m31();
  for (const char* name : {"dspark_markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
                           "sliding_window", "layer_types", "swiglu_alpha", "swiglu_limit",
                           "quantization_config", "hidden_act", "use_gemma_norm",
                           "dspark_hybrid_context_fusion", "dspark_config"})
    d.erase(name);
  const DsparkConfig c = parse(d);
  EXPECT_EQ(c.markov_head_type, "vanilla");
  EXPECT_FALSE(c.confidence_head);
  EXPECT_FALSE(c.confidence_with_markov);
  EXPECT_EQ(c.sliding_window, 0);
  EXPECT_EQ(c.swiglu_alpha, 1.702f);
  EXPECT_EQ(c.swiglu_beta, 1.0f);
  EXPECT_EQ(c.swiglu_limit, 7.0f);
  EXPECT_EQ(c.quant, DsparkQuant::kBFloat16);
  EXPECT_EQ(c.rotary_dim, 64);
  // head_dim: hidden_size / num_attention_heads when absent.
  d.erase("head_dim").set("hidden_size", "8192");
  EXPECT_EQ(parse(d).head_dim, 128);
}

TEST(DsparkConfig, AcceptsTheAlternateNames) {
  Doc d = m31();
  d.erase("dspark_ffn_hidden_size").erase("dspark_block_size").erase("dspark_noise_token_id");
  d.erase("dspark_target_layer_ids").erase("dspark_markov_rank").erase("dspark_markov_head_type");
  d.set("dense_intermediate_size", "12288").set("block_size", "7").set("mask_token_id", "200058");
  d.set("target_layer_ids", "[3,17,31,45,59]").set("markov_rank", "256");
  d.set("markov_head_type", "\"vanilla\"");
  expect_same(parse(d), parse_dspark_config(kM31, "m31"));

  // The dflash_config object, and intermediate_size.
  Doc n = m31();
  n.erase("dspark_ffn_hidden_size").erase("dspark_block_size").erase("dspark_noise_token_id");
  n.erase("dspark_target_layer_ids");
  n.set("intermediate_size", "12288");
  n.set("dflash_config", R"({"block_size":7,"mask_token_id":200058,"target_layer_ids":[3,17,31,45,59]})");
  expect_same(parse(n), parse_dspark_config(kM31, "m31"));

  // rotary_dim given directly instead of partial_rotary_factor.
  Doc r = m31();
  r.erase("partial_rotary_factor").set("rotary_dim", "32");
  EXPECT_EQ(parse(r).rotary_dim, 32);
}

TEST(DsparkConfig, EqualDuplicatesAreAccepted) {
  Doc d = m31();
  d.set("dense_intermediate_size", "12288").set("intermediate_size", "12288").set("block_size", "7");
  d.set("mask_token_id", "200058").set("target_layer_ids", "[3,17,31,45,59]").set("markov_rank", "256");
  d.set("dflash_config", R"({"block_size":7,"mask_token_id":200058,"target_layer_ids":[3,17,31,45,59]})");
  d.set("markov_head_type", "\"vanilla\"").set("rotary_dim", "64");
  expect_same(parse(d), parse_dspark_config(kM31, "m31"));
}

TEST(DsparkConfig, ConflictingDuplicatesAreErrors) {
  // {member to add, its JSON, the name it conflicts with}.
  const std::vector<std::vector<std::string>> cases = {
      {"dense_intermediate_size", "3072", "dspark_ffn_hidden_size"},
      {"intermediate_size", "3072", "dspark_ffn_hidden_size"},
      {"block_size", "8", "dspark_block_size"},
      {"mask_token_id", "200057", "dspark_noise_token_id"},
      {"target_layer_ids", "[3,17,31,45]", "dspark_target_layer_ids"},
      {"markov_rank", "128", "dspark_markov_rank"},
      {"markov_head_type", "\"tree\"", "dspark_markov_head_type"},
      {"rotary_dim", "32", "partial_rotary_factor"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c[0]);
    expect_error(m31().set(c[0], c[1]), {c[0], c[2]});
  }
  expect_error(m31().set("dflash_config", R"({"block_size":6})"),
               {"dspark_block_size = 7", "dflash_config.block_size = 6"});
  // Two alternates, the canonical name absent.
  Doc alt = m31();
  alt.erase("dspark_block_size").set("block_size", "7").set("dflash_config", R"({"block_size":6})");
  expect_error(alt, {"block_size = 7", "dflash_config.block_size = 6"});
  expect_error(m31().set("dspark_config", R"({"hybrid_context_fusion":true})"),
               {"dspark_hybrid_context_fusion", "dspark_config.hybrid_context_fusion"});
}

TEST(DsparkConfig, MissingRequiredFields) {
  // {canonical name, every name to remove}.
  const std::vector<std::vector<std::string>> cases = {
      {"num_hidden_layers"},      {"hidden_size"},         {"num_attention_heads"},
      {"num_key_value_heads"},    {"vocab_size"},          {"rms_norm_eps"},
      {"rope_theta"},             {"max_position_embeddings"},
      {"dspark_ffn_hidden_size", "dense_intermediate_size", "intermediate_size"},
      {"dspark_block_size", "block_size"},
      {"dspark_noise_token_id", "mask_token_id"},
      {"dspark_target_layer_ids", "target_layer_ids"},
      {"dspark_markov_rank", "markov_rank"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c[0]);
    Doc d = m31();
    for (const std::string& name : c) d.erase(name);
    std::vector<std::string> fragments = {"missing " + c[0]};
    if (c.size() > 1) fragments.push_back(c[1]);  // the accepted names are listed
    expect_error(d, fragments);
  }
  // A dflash_config object without the member is still missing.
  expect_error(m31().erase("dspark_block_size").set("dflash_config", R"({"mask_token_id":200058})"),
               {"missing dspark_block_size", "dflash_config.block_size"});
}

TEST(DsparkConfig, WrongJsonKindsAreErrors) {
  // {member, JSON, a fragment of the message beyond the name}.
  const std::vector<std::vector<std::string>> cases = {
      {"hidden_size", "6144.0", "not an integer"},
      {"hidden_size", "6.144e3", "not an integer"},
      {"hidden_size", "\"6144\"", "expected a number"},
      {"num_hidden_layers", "true", "expected a number"},
      {"vocab_size", "null", "expected a number"},
      {"max_position_embeddings", "1048576.5", "not an integer"},
      {"dspark_block_size", "7.5", "not an integer"},
      {"dspark_target_layer_ids", "[3, 17.5]", "not an integer"},
      {"dspark_target_layer_ids", "3", "expected an array"},
      {"sliding_window", "4096.0", "not an integer"},
      {"rotary_dim", "64.0", "not an integer"},
      {"enable_confidence_head", "1", "expected a boolean"},
      {"confidence_head_with_markov", "\"true\"", "expected a boolean"},
      {"use_gemma_norm", "1", "expected a boolean"},
      {"rms_norm_eps", "\"1e-6\"", "expected a number"},
      {"rope_theta", "[5e6]", "expected a number"},
      {"swiglu_alpha", "true", "expected a number"},
      {"partial_rotary_factor", "\"0.5\"", "expected a number"},
      {"dspark_markov_head_type", "1", "expected a string"},
      {"hidden_act", "null", "expected a string"},
      {"layer_types", "\"sliding_attention\"", "expected an array"},
      {"quantization_config", "\"mxfp8\"", "expected an object"},
      {"dflash_config", "7", "expected an object"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c[0] + " = " + c[1]);
    expect_error(m31().set(c[0], c[1]), {c[0], c[2]});
  }
  expect_error(m31().set("dspark_target_layer_ids", "[3, \"17\"]"), {"dspark_target_layer_ids[1]"});
  expect_error(m31().set("layer_types", "[1,2,3,4,5]"), {"layer_types[0]", "expected a string"});
  // Integers must fit in int; max_position_embeddings is 64-bit.
  expect_error(m31().set("hidden_size", "4294967296"), {"hidden_size = 4294967296", "does not fit in int"});
  expect_error(m31().set("dspark_noise_token_id", "-2147483649"), {"dspark_noise_token_id", "does not fit"});
  expect_error(m31().set("dspark_target_layer_ids", "[3, 2147483648]"),
               {"dspark_target_layer_ids[1] = 2147483648", "does not fit"});
  expect_error(m31().set("max_position_embeddings", "9223372036854775808"), {"max_position_embeddings"});
  Doc big = m31();
  big.set("max_position_embeddings", "4294967296");
  EXPECT_EQ(parse(big).max_position_embeddings, int64_t(4294967296));
  // Floats must fit in float.
  expect_error(m31().set("swiglu_limit", "1e39"), {"swiglu_limit = 1e+39", "out of float range"});
}

TEST(DsparkConfig, ValidationRulesNameTheField) {
  // {member, JSON, fragments of the message}: every rule of the header, each message naming the field.
  const std::vector<std::vector<std::string>> cases = {
      {"num_hidden_layers", "0", "num_hidden_layers = 0: must be > 0"},
      {"hidden_size", "-6144", "hidden_size = -6144: must be > 0"},
      {"num_attention_heads", "0", "num_attention_heads = 0: must be > 0"},
      {"num_key_value_heads", "0", "num_key_value_heads = 0: must be > 0"},
      {"dspark_ffn_hidden_size", "0", "dspark_ffn_hidden_size = 0: must be > 0"},
      {"vocab_size", "-1", "vocab_size = -1: must be > 0"},
      {"max_position_embeddings", "0", "max_position_embeddings = 0: must be > 0"},
      {"dspark_markov_rank", "0", "dspark_markov_rank = 0: must be > 0"},
      {"num_key_value_heads", "3", "num_key_value_heads = 3: must divide num_attention_heads = 64"},
      {"num_key_value_heads", "2", "num_key_value_heads = 2", "32 must be 1, 2, 4, 8 or 16"},
      {"head_dim", "64", "head_dim = 64: must be 128"},
      {"head_dim", "0", "head_dim = 0: must be 128"},
      {"rotary_dim", "48", "rotary_dim = 48", "disagrees"},
      {"partial_rotary_factor", "0.3", "partial_rotary_factor = 0.3", "not a whole rotary_dim"},
      {"partial_rotary_factor", "0.75", "rotary_dim", "= 96: must be 16, 32 or 64"},
      {"partial_rotary_factor", "-0.25", "rotary_dim", "= -32: must be 16, 32 or 64"},
      {"dspark_block_size", "0", "dspark_block_size = 0: must be in 1..16"},
      {"dspark_block_size", "17", "dspark_block_size = 17: must be in 1..16"},
      {"dspark_target_layer_ids", "[]", "dspark_target_layer_ids = []: must not be empty"},
      {"dspark_target_layer_ids", "[-1, 3]", "dspark_target_layer_ids = [-1, 3]: ids must be >= 0"},
      {"dspark_target_layer_ids", "[3, 3]", "dspark_target_layer_ids = [3, 3]: ids must be strictly"},
      {"dspark_target_layer_ids", "[17, 3]", "dspark_target_layer_ids", "strictly increasing"},
      {"dspark_noise_token_id", "200064", "dspark_noise_token_id = 200064", "< vocab_size = 200064"},
      {"dspark_noise_token_id", "-1", "dspark_noise_token_id = -1", ">= 0"},
      {"dspark_markov_head_type", "\"tree\"", "dspark_markov_head_type = \"tree\"", "only \"vanilla\""},
      {"rms_norm_eps", "0", "rms_norm_eps = 0: must be > 0"},
      {"rms_norm_eps", "-1e-06", "rms_norm_eps = -1e-06: must be > 0"},
      {"rms_norm_eps", "1e-50", "rms_norm_eps = 1e-50: must be > 0"},  // 0 as a float
      {"rope_theta", "0", "rope_theta = 0: must be > 0"},
      {"rope_theta", "-5e6", "rope_theta = -5e+06: must be > 0"},
      {"sliding_window", "-1", "sliding_window = -1: must be >= 0"},
      {"hidden_act", "\"silu\"", "hidden_act = \"silu\"", "swigluoai"},
      {"use_gemma_norm", "false", "use_gemma_norm = false: must be true"},
      {"layer_types", R"(["sliding_attention","sliding_attention"])", "layer_types has 2 entries",
       "num_hidden_layers = 5"},
      {"layer_types", R"(["sliding_attention","sliding_attention","full_attention","sliding_attention",
                          "sliding_attention"])",
       "layer_types[2] = \"full_attention\"", "differs"},
      {"layer_types", R"(["sliding_attention","sliding_attention","sliding_attention","sliding_attention",
                          "linear_attention"])",
       "layer_types[4] = \"linear_attention\"", "must be \"sliding_attention\" or \"full_attention\""},
      {"sliding_window", "0", "sliding_window = 0: must be > 0 when layer_types are sliding_attention"},
      {"quantization_config", R"({"quant_method":"fp8","weight_block_size":[128,128]})",
       "quantization_config.quant_method = \"fp8\"", "only \"mxfp8\""},
      {"quantization_config", R"({"quant_method":"mxfp8","weight_block_size":[1,16]})",
       "quantization_config.weight_block_size = [1, 16]", "[1, 32]"},
      {"quantization_config", R"({"quant_method":"mxfp8"})", "missing quantization_config.weight_block_size"},
      {"quantization_config", R"({"weight_block_size":[1,32]})", "missing quantization_config.quant_method"},
      {"quantization_config", R"({"quant_method":"mxfp8","weight_block_size":"1x32"})",
       "quantization_config.weight_block_size", "expected an array"},
      {"hidden_size", "6160", "hidden_size = 6160: must be a multiple of 32 with mxfp8"},
      {"dspark_ffn_hidden_size", "12300", "dspark_ffn_hidden_size = 12300: must be a multiple of 32"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c[0] + " = " + c[1]);
    expect_error(m31().set(c[0], c[1]), std::vector<std::string>(c.begin() + 2, c.end()));
  }

  // The header's own example.
  Doc tiny16 = m31();
  tiny16.set("num_attention_heads", "16").set("num_key_value_heads", "3");
  try {
    parse_dspark_config(tiny16.text(), "tiny/config.json");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "tiny/config.json: num_key_value_heads = 3: must divide num_attention_heads = 16");
  }
  expect_error(m31().erase("dspark_config").set("dspark_hybrid_context_fusion", "true"),
               {"dspark_hybrid_context_fusion = true: hybrid context fusion is not supported"});
  Doc nested = m31();
  nested.erase("dspark_hybrid_context_fusion").set("dspark_config", R"({"hybrid_context_fusion":true})");
  expect_error(nested,
               {"dspark_config.hybrid_context_fusion = true: hybrid context fusion is not supported"});
  // Rules that need more than one member changed. The name found is the one the message uses.
  expect_error(m31().erase("dspark_block_size").set("block_size", "20"),
               {"block_size = 20: must be in 1..16"});
  expect_error(m31().erase("dspark_block_size").set("dflash_config", R"({"block_size":0})"),
               {"dflash_config.block_size = 0: must be in 1..16"});
  // head_dim derived when absent: 6144 / 64 = 96.
  expect_error(m31().erase("head_dim"),
               {"head_dim = 96", "hidden_size / num_attention_heads", "must be 128"});
  expect_error(m31().erase("head_dim").set("hidden_size", "6176"),
               {"head_dim is absent", "hidden_size = 6176", "not a multiple of num_attention_heads = 64"});
  // Neither rotary_dim nor partial_rotary_factor: the default factor 1 gives 128, which no kernel takes.
  expect_error(m31().erase("partial_rotary_factor"),
               {"rotary_dim (head_dim 128 * partial_rotary_factor 1 (the default) = 128) = 128",
                "16, 32 or 64"});
  expect_error(m31().erase("partial_rotary_factor").set("rotary_dim", "128"),
               {"rotary_dim = 128: must be 16, 32"});
  expect_error(m31().erase("partial_rotary_factor").set("rotary_dim", "0"),
               {"rotary_dim = 0: must be 16, 32"});
  // Full attention layers with a window contradict each other.
  const std::string full =
      R"(["full_attention","full_attention","full_attention","full_attention","full_attention"])";
  expect_error(m31().set("layer_types", full), {"sliding_window = 4096", "full_attention"});
  Doc f = m31();
  f.set("layer_types", full).erase("sliding_window");
  EXPECT_EQ(parse(f).sliding_window, 0);
  // The window without layer_types is enough.
  Doc w = m31();
  w.erase("layer_types");
  EXPECT_EQ(parse(w).sliding_window, 4096);
  // bf16 has no multiple-of-32 rule.
  Doc b = m31();
  b.erase("quantization_config").set("hidden_size", "6160");
  EXPECT_EQ(parse(b).hidden_size, 6160);
}

TEST(DsparkConfig, GroupsAndBlockBounds) {
  for (int kv : {64, 32, 16, 8, 4}) {  // groups 1, 2, 4, 8, 16
    Doc d = m31();
    d.set("num_key_value_heads", std::to_string(kv));
    EXPECT_EQ(parse(d).num_kv_heads, kv);
  }
  for (int b : {1, 16}) {
    Doc d = m31();
    d.set("dspark_block_size", std::to_string(b));
    EXPECT_EQ(parse(d).block_size, b);
  }
  for (const auto& [factor, dim] : {std::pair<const char*, int>{"0.125", 16}, {"0.25", 32}}) {
    Doc d = m31();
    d.set("partial_rotary_factor", factor);
    EXPECT_EQ(parse(d).rotary_dim, dim);
  }
  Doc d = m31();
  d.set("dspark_noise_token_id", "200063").set("dspark_target_layer_ids", "[0]");
  EXPECT_EQ(parse(d).mask_token_id, 200063);
}

TEST(DsparkConfig, UnknownFieldsAreIgnored) {
  Doc d = m31();
  d.set("some_future_field", R"({"nested":[1,2,{"x":null}],"y":"z"})").set("another", "null");
  d.set("rope_scaling", "null").set("tie_word_embeddings", "false").set("num_speculative_tokens", "7");
  d.set("dflash_config", R"({"unrelated":true})");
  d.set("quantization_config",
        R"({"quant_method":"mxfp8","weight_block_size":[1,32],"kv_cache_scheme":null})");
  expect_same(parse(d), parse_dspark_config(kM31, "m31"));
}

TEST(DsparkConfig, DocumentErrorsNameTheDocument) {
  try {
    parse_dspark_config("[1, 2]", "cfg.json");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "cfg.json: is an array, expected an object");
  }
  try {
    parse_dspark_config("{\"hidden_size\": 6144,}", "cfg.json");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("cfg.json: JSON error at byte", 0), 0u) << e.what();
  }
}

TEST(DsparkConfig, JsonRoundTrips) {
  const DsparkConfig m = parse_dspark_config(kM31, "m31");
  const std::string text = dspark_config_json(m);
  expect_same(parse_dspark_config(text, "written"), m);
  // Canonical names and the fixed fields.
  const Json j = detail::parse_json(text, "written");
  for (const char* name : {"num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                           "head_dim", "dspark_ffn_hidden_size", "vocab_size", "dspark_block_size",
                           "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank",
                           "dspark_markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
                           "sliding_window", "rms_norm_eps", "rope_theta", "rotary_dim", "swiglu_alpha",
                           "swiglu_beta", "swiglu_limit", "max_position_embeddings", "hidden_act",
                           "use_gemma_norm", "architectures", "quantization_config"})
    EXPECT_NE(j.find(name), nullptr) << name;
  EXPECT_EQ(j.find("hidden_act")->as_string("hidden_act"), "swigluoai");
  EXPECT_TRUE(j.find("use_gemma_norm")->as_bool("use_gemma_norm"));
  EXPECT_EQ(j.find("architectures")->dump(), R"(["DSparkMiniMaxDraftModel"])");
  EXPECT_EQ(j.find("quantization_config")->dump(), R"({"quant_method":"mxfp8","weight_block_size":[1,32]})");

  const DsparkConfig t = tiny();
  const std::string tiny_text = dspark_config_json(t);
  expect_same(parse_dspark_config(tiny_text, "tiny"), t);
  EXPECT_EQ(detail::parse_json(tiny_text, "tiny").find("quantization_config"), nullptr);

  // Floats that are not short decimals, and the non-default options.
  DsparkConfig o = tiny();
  o.rms_norm_eps = 1.0f / 3.0f * 1e-5f;
  o.rope_theta = 1.0 / 3.0 * 1e6;
  o.swiglu_alpha = 0.1f;
  o.swiglu_beta = -2.5f;
  o.swiglu_limit = 1e-30f;
  o.confidence_head = true;
  o.confidence_with_markov = true;
  o.sliding_window = 128;
  o.rotary_dim = 16;
  o.max_position_embeddings = int64_t(1) << 40;
  o.quant = DsparkQuant::kMxfp8;
  expect_same(parse_dspark_config(dspark_config_json(o), "o"), o);
}

TEST(DsparkConfig, JsonRefusesAnInvalidConfig) {
  DsparkConfig c = tiny();
  c.num_kv_heads = 3;
  EXPECT_THROW(dspark_config_json(c), Error);
  c = tiny();
  c.markov_head_type = "tree";
  EXPECT_THROW(dspark_config_json(c), Error);
  c = tiny();
  c.quant = DsparkQuant::kMxfp8;
  c.hidden_size = 250;
  EXPECT_THROW(dspark_config_json(c), Error);
  EXPECT_THROW(dspark_config_json(DsparkConfig{}), Error);
}

using m3rt::detail::TempDir;

TEST(DsparkConfig, ReadsAFile) {
  TempDir dir;
  const std::string path = dir.file("config.json");
  std::ofstream(path, std::ios::binary) << kM31;
  expect_same(read_dspark_config(path), parse_dspark_config(kM31, "m31"));

  // Parse errors name the path.
  const std::string bad = dir.file("bad.json");
  std::ofstream(bad, std::ios::binary) << m31().set("dspark_block_size", "0").text();
  try {
    read_dspark_config(bad);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind(bad + ": dspark_block_size = 0", 0), 0u) << e.what();
  }
}

TEST(DsparkConfig, FileErrorsNameThePath) {
  TempDir dir;
  for (const std::string& path : {dir.file("absent.json"), dir.file("")}) {  // a missing file; a directory
    SCOPED_TRACE(path);
    try {
      read_dspark_config(path);
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).rfind(path + ": cannot ", 0), 0u) << e.what();
    }
  }
}

// Every input of the fuzzer's corpus (scripts/fuzz.sh dspark_config) parses or raises m3rt::Error,
// and a config that parses reads back the same through dspark_config_json.
TEST(DsparkConfig, FuzzCorpusNeverCrashes) {
  const std::filesystem::path corpus = m3rt_source_dir() / "tests" / "fuzz" / "corpus" / "dspark_config";
  ASSERT_TRUE(std::filesystem::is_directory(corpus)) << corpus;
  int files = 0, parsed = 0;
  for (const auto& entry : std::filesystem::directory_iterator(corpus)) {
    std::ifstream in(entry.path(), std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    ++files;
    DsparkConfig c;
    try {
      c = parse_dspark_config(text, entry.path().filename().string());
    } catch (const Error&) {
      continue;
    }
    ++parsed;
    const DsparkConfig back = parse_dspark_config(dspark_config_json(c), "round trip");
    EXPECT_EQ(back.num_layers, c.num_layers) << entry.path();
    EXPECT_EQ(back.target_layer_ids, c.target_layer_ids) << entry.path();
    EXPECT_EQ(back.rope_theta, c.rope_theta) << entry.path();
  }
  EXPECT_GT(files, 10);
  EXPECT_GT(parsed, 0);
}

}  // namespace
