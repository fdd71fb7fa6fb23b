// Reading and validating a DSpark draft model's config.json, and writing one. Field names,
// defaults and rules: include/m3rt/dspark_config.h.
#include "m3rt/dspark_config.h"

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <optional>
#include <utility>

#include "core/json.h"
#include "m3rt/error.h"

namespace m3rt {

namespace {

using detail::Json;

// The names a field may be given under, canonical first. "a.b" is member b of the object member a.
using Names = std::initializer_list<std::string_view>;

// A field's value and the name it was found under (the first of its names present), which is the
// name its errors use.
template <class T>
struct Found {
  std::string name;
  T value;
};

// Values as messages show them: numbers in their shortest exact form, strings quoted.
std::string show(int64_t v) { return std::to_string(v); }
std::string show(int v) { return std::to_string(v); }
std::string show(bool v) { return v ? "true" : "false"; }
std::string show(double v) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, r.ptr);
}
std::string show(const std::string& v) { return "\"" + v + "\""; }
std::string show(const std::vector<int>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

bool fits_int(int64_t v) {
  return v >= std::numeric_limits<int>::min() && v <= std::numeric_limits<int>::max();
}

// Looks fields up under their accepted names, reads them with the JSON's typed accessors and raises
// errors prefixed with the document's name.
class Reader {
 public:
  Reader(const Json& root, std::string_view what) : root_(root), what_(what) {
    root.as_object(what_);  // a config.json is one object
  }

  [[noreturn]] void fail(const std::string& msg) const { throw Error(what_ + ": " + msg); }

  // "<name> = <value>: <rule>".
  template <class T>
  [[noreturn]] void bad(const Found<T>& f, const std::string& rule) const {
    fail(f.name + " = " + show(f.value) + ": " + rule);
  }

  // The member `name` ("a.b": member b of object member a), or nullptr when absent.
  const Json* lookup(std::string_view name) const {
    const size_t dot = name.find('.');
    if (dot == std::string_view::npos) return root_.find(name);
    const std::string_view parent = name.substr(0, dot);
    const Json* p = root_.find(parent);
    if (p == nullptr) return nullptr;
    // A parent of another kind is an error rather than "absent": it cannot be what the writer meant.
    p->as_object(path(parent));
    return p->find(name.substr(dot + 1));
  }

  std::optional<Found<int>> opt_int(Names names) const {
    return find<int>(names, [&](const Json& j, const std::string& name) { return to_int(j, name); });
  }
  std::optional<Found<int64_t>> opt_int64(Names names) const {
    return find<int64_t>(names, [&](const Json& j, const std::string& name) { return j.as_int(path(name)); });
  }
  std::optional<Found<double>> opt_double(Names names) const {
    return find<double>(names,
                        [&](const Json& j, const std::string& name) { return j.as_double(path(name)); });
  }
  // A number stored as float: refused when beyond float's range (the conversion would be undefined).
  // Kept as the double read so that messages show what the document says.
  std::optional<Found<double>> opt_float(Names names) const {
    return find<double>(names, [&](const Json& j, const std::string& name) {
      const double v = j.as_double(path(name));
      if (std::fabs(v) > double(std::numeric_limits<float>::max()))
        fail(name + " = " + show(v) + ": out of float range");
      return v;
    });
  }
  std::optional<Found<bool>> opt_bool(Names names) const {
    return find<bool>(names, [&](const Json& j, const std::string& name) { return j.as_bool(path(name)); });
  }
  std::optional<Found<std::string>> opt_string(Names names) const {
    return find<std::string>(names,
                             [&](const Json& j, const std::string& name) { return j.as_string(path(name)); });
  }
  std::optional<Found<std::vector<int>>> opt_int_list(Names names) const {
    return find<std::vector<int>>(names, [&](const Json& j, const std::string& name) {
      std::vector<int> v;
      const std::vector<Json>& items = j.as_array(path(name));
      for (size_t i = 0; i < items.size(); ++i)
        v.push_back(to_int(items[i], name + "[" + std::to_string(i) + "]"));
      return v;
    });
  }

  // The value of a required field; "missing <canonical name>" (with its other names) when absent.
  template <class T>
  Found<T> need(std::optional<Found<T>> f, Names names) const {
    if (f) return std::move(*f);
    std::string msg = "missing " + std::string(*names.begin());
    if (names.size() > 1) {
      msg += " (accepted names:";
      for (std::string_view n : names) msg += (n == *names.begin() ? " " : ", ") + std::string(n);
      msg += ")";
    }
    fail(msg);
  }

  std::string path(std::string_view name) const { return what_ + ": " + std::string(name); }

 private:
  int to_int(const Json& j, const std::string& name) const {
    const int64_t v = j.as_int(path(name));
    if (!fits_int(v)) fail(name + " = " + show(v) + ": does not fit in int");
    return int(v);
  }

  // The field under the first of `names` present, read by `get`. Every other name present must
  // hold the same value: two different values leave no way to tell which one the writer meant.
  template <class T, class Get>
  std::optional<Found<T>> find(Names names, Get get) const {
    std::optional<Found<T>> found;
    for (std::string_view n : names) {
      const Json* j = lookup(n);
      if (j == nullptr) continue;
      const std::string name(n);
      T v = get(*j, name);
      if (!found) {
        found = Found<T>{name, std::move(v)};
      } else if (!(v == found->value)) {
        fail(found->name + " = " + show(found->value) + " and " + name + " = " + show(v) +
             ": the same field given two different values");
      }
    }
    return found;
  }

  const Json& root_;
  std::string what_;
};

const Names kLayers = {"num_hidden_layers"};
const Names kHidden = {"hidden_size"};
const Names kHeads = {"num_attention_heads"};
const Names kKvHeads = {"num_key_value_heads"};
const Names kHeadDim = {"head_dim"};
const Names kFfn = {"dspark_ffn_hidden_size", "dense_intermediate_size", "intermediate_size"};
const Names kVocab = {"vocab_size"};
const Names kBlock = {"dspark_block_size", "block_size", "dflash_config.block_size"};
const Names kMask = {"dspark_noise_token_id", "mask_token_id", "dflash_config.mask_token_id"};
const Names kTargets = {"dspark_target_layer_ids", "target_layer_ids", "dflash_config.target_layer_ids"};
const Names kRank = {"dspark_markov_rank", "markov_rank"};
const Names kHeadType = {"dspark_markov_head_type", "markov_head_type"};
const Names kConfidence = {"enable_confidence_head"};
const Names kConfidenceMarkov = {"confidence_head_with_markov"};
const Names kWindow = {"sliding_window"};
const Names kEps = {"rms_norm_eps"};
const Names kTheta = {"rope_theta"};
const Names kRotary = {"rotary_dim"};
const Names kRotaryFactor = {"partial_rotary_factor"};
const Names kAlpha = {"swiglu_alpha"};
const Names kBeta = {"swiglu_beta"};
const Names kLimit = {"swiglu_limit"};
const Names kMaxPos = {"max_position_embeddings"};
const Names kAct = {"hidden_act"};
const Names kGemmaNorm = {"use_gemma_norm"};
// The nested spelling is the same switch as written by the training recipe (dspark.md §1).
const Names kFusion = {"dspark_hybrid_context_fusion", "dspark_config.hybrid_context_fusion"};

// layer_types, when present: num_layers entries, all sliding or all full attention, agreeing with
// sliding_window.
void check_layer_types(const Reader& r, const Found<int>& layers, int sliding_window) {
  const Json* lt = r.lookup("layer_types");
  if (lt == nullptr) return;
  const std::vector<Json>& items = lt->as_array(r.path("layer_types"));
  if (items.size() != size_t(layers.value))
    r.fail("layer_types has " + std::to_string(items.size()) + " entries: must have " + layers.name + " = " +
           show(layers.value));
  std::string first;
  for (size_t i = 0; i < items.size(); ++i) {
    const std::string name = "layer_types[" + std::to_string(i) + "]";
    const std::string& t = items[i].as_string(r.path(name));
    if (t != "sliding_attention" && t != "full_attention")
      r.fail(name + " = " + show(t) + ": must be \"sliding_attention\" or \"full_attention\"");
    if (i == 0) first = t;
    if (t != first)
      r.fail(name + " = " + show(t) + ": differs from layer_types[0] = " + show(first) +
             " (every draft layer must use the same attention)");
  }
  if (first == "sliding_attention" && sliding_window <= 0)
    r.fail("sliding_window = " + show(sliding_window) +
           ": must be > 0 when layer_types are sliding_attention");
  // A window with full-attention layers is contradictory; refused rather than guessing which one holds.
  if (first == "full_attention" && sliding_window != 0)
    r.fail("sliding_window = " + show(sliding_window) +
           ": must be 0 or absent when layer_types are full_attention");
}

// quantization_config: absent -> bf16; {"quant_method": "mxfp8", "weight_block_size": [1, 32]}.
DsparkQuant read_quant(const Reader& r) {
  const Json* qc = r.lookup("quantization_config");
  if (qc == nullptr) return DsparkQuant::kBFloat16;
  qc->as_object(r.path("quantization_config"));
  // A quantization_config without a method says the weights are quantized somehow; reading them as
  // bf16 would be wrong, so it is refused rather than defaulted.
  const std::optional<Found<std::string>> method = r.opt_string({"quantization_config.quant_method"});
  if (!method) r.fail("missing quantization_config.quant_method");
  if (method->value != "mxfp8")
    r.bad(*method, "only \"mxfp8\" is supported (no quantization_config: bf16)");
  const std::optional<Found<std::vector<int>>> block =
      r.opt_int_list({"quantization_config.weight_block_size"});
  if (!block) r.fail("missing quantization_config.weight_block_size (mxfp8 needs [1, 32])");
  if (block->value != std::vector<int>{1, 32}) r.bad(*block, "mxfp8 needs [1, 32]");
  return DsparkQuant::kMxfp8;
}

}  // namespace

DsparkConfig parse_dspark_config(std::string_view json_text, std::string_view what) {
  const Json root = detail::parse_json(json_text, what);
  const Reader r(root, what);

  // Everything is read (kinds, duplicates, presence) before any rule is checked.
  const Found<int> layers = r.need(r.opt_int(kLayers), kLayers);
  const Found<int> hidden = r.need(r.opt_int(kHidden), kHidden);
  const Found<int> heads = r.need(r.opt_int(kHeads), kHeads);
  const Found<int> kv_heads = r.need(r.opt_int(kKvHeads), kKvHeads);
  const std::optional<Found<int>> head_dim = r.opt_int(kHeadDim);
  const Found<int> ffn = r.need(r.opt_int(kFfn), kFfn);
  const Found<int> vocab = r.need(r.opt_int(kVocab), kVocab);
  const Found<int> block = r.need(r.opt_int(kBlock), kBlock);
  const Found<int> mask = r.need(r.opt_int(kMask), kMask);
  const Found<std::vector<int>> targets = r.need(r.opt_int_list(kTargets), kTargets);
  const Found<int> rank = r.need(r.opt_int(kRank), kRank);
  const std::optional<Found<std::string>> head_type = r.opt_string(kHeadType);
  const std::optional<Found<bool>> confidence = r.opt_bool(kConfidence);
  const std::optional<Found<bool>> confidence_markov = r.opt_bool(kConfidenceMarkov);
  const std::optional<Found<int>> window = r.opt_int(kWindow);
  const Found<double> eps = r.need(r.opt_float(kEps), kEps);
  const Found<double> theta = r.need(r.opt_double(kTheta), kTheta);
  const std::optional<Found<int>> rotary = r.opt_int(kRotary);
  const std::optional<Found<double>> rotary_factor = r.opt_double(kRotaryFactor);
  const std::optional<Found<double>> alpha = r.opt_float(kAlpha);
  const std::optional<Found<double>> beta = r.opt_float(kBeta);
  const std::optional<Found<double>> limit = r.opt_float(kLimit);
  const Found<int64_t> max_pos = r.need(r.opt_int64(kMaxPos), kMaxPos);
  const std::optional<Found<std::string>> act = r.opt_string(kAct);
  const std::optional<Found<bool>> gemma_norm = r.opt_bool(kGemmaNorm);
  const std::optional<Found<bool>> fusion = r.opt_bool(kFusion);

  DsparkConfig c;
  for (const Found<int>* f : {&layers, &hidden, &heads, &kv_heads, &ffn, &vocab, &rank})
    if (f->value <= 0) r.bad(*f, "must be > 0");
  if (max_pos.value <= 0) r.bad(max_pos, "must be > 0");
  c.num_layers = layers.value;
  c.hidden_size = hidden.value;
  c.num_heads = heads.value;
  c.num_kv_heads = kv_heads.value;
  c.ffn_size = ffn.value;
  c.vocab_size = vocab.value;
  c.markov_rank = rank.value;
  c.max_position_embeddings = max_pos.value;

  if (heads.value % kv_heads.value != 0)
    r.bad(kv_heads, "must divide " + heads.name + " = " + show(heads.value));
  const int group = heads.value / kv_heads.value;
  if (group != 1 && group != 2 && group != 4 && group != 8 && group != 16)
    r.bad(kv_heads, "the group " + heads.name + " / " + kv_heads.name + " = " + show(group) +
                        " must be 1, 2, 4, 8 or 16");

  if (head_dim) {
    if (head_dim->value != 128) r.bad(*head_dim, "must be 128 (the kernels' head size)");
  } else {
    if (hidden.value % heads.value != 0)
      r.fail("head_dim is absent and " + hidden.name + " = " + show(hidden.value) + " is not a multiple of " +
             heads.name + " = " + show(heads.value));
    const int derived = hidden.value / heads.value;
    if (derived != 128)
      r.fail("head_dim = " + show(derived) + " (absent: " + hidden.name + " / " + heads.name +
             "): must be 128 (the kernels' head size)");
  }
  c.head_dim = 128;

  // rotary_dim, or head_dim * partial_rotary_factor; when both are given they must agree.
  const double factor = rotary_factor ? rotary_factor->value : 1.0;
  const double product = c.head_dim * factor;
  const bool whole = product == std::floor(product) && std::fabs(product) <= 1 << 20;
  std::string from_factor = "head_dim " + show(c.head_dim) + " * partial_rotary_factor " + show(factor);
  if (!rotary_factor) from_factor += " (the default)";
  from_factor += " = " + show(product);
  if (rotary) {
    if (rotary_factor && (!whole || int(product) != rotary->value))
      r.bad(*rotary, "disagrees with " + from_factor);
    c.rotary_dim = rotary->value;
  } else {
    if (!whole)
      r.fail("partial_rotary_factor = " + show(factor) + ": " + from_factor + " is not a whole rotary_dim");
    c.rotary_dim = int(product);
  }
  if (c.rotary_dim != 16 && c.rotary_dim != 32 && c.rotary_dim != 64) {
    const std::string source = rotary ? rotary->name : "rotary_dim (" + from_factor + ")";
    r.fail(source + " = " + show(c.rotary_dim) + ": must be 16, 32 or 64 (the kernels' partial rotary dims)");
  }

  if (block.value < 1 || block.value > 16) r.bad(block, "must be in 1..16");
  c.block_size = block.value;

  if (targets.value.empty()) r.bad(targets, "must not be empty");
  for (size_t i = 0; i < targets.value.size(); ++i) {
    if (targets.value[i] < 0) r.bad(targets, "ids must be >= 0");
    if (i > 0 && targets.value[i] <= targets.value[i - 1]) r.bad(targets, "ids must be strictly increasing");
  }
  c.target_layer_ids = targets.value;

  if (mask.value < 0 || mask.value >= vocab.value)
    r.bad(mask, "must be >= 0 and < " + vocab.name + " = " + show(vocab.value));
  c.mask_token_id = mask.value;

  if (head_type) {
    if (head_type->value != "vanilla") r.bad(*head_type, "only \"vanilla\" is supported");
    c.markov_head_type = head_type->value;
  }
  c.confidence_head = confidence && confidence->value;
  c.confidence_with_markov = confidence_markov && confidence_markov->value;

  if (window) {
    if (window->value < 0) r.bad(*window, "must be >= 0 (0: no window)");
    c.sliding_window = window->value;
  }

  // Compared after the conversion: a value that underflows float is 0 to the kernels.
  c.rms_norm_eps = float(eps.value);
  if (!(c.rms_norm_eps > 0)) r.bad(eps, "must be > 0 (as a float)");
  if (!(theta.value > 0)) r.bad(theta, "must be > 0");
  c.rope_theta = theta.value;
  if (alpha) c.swiglu_alpha = float(alpha->value);
  if (beta) c.swiglu_beta = float(beta->value);
  if (limit) c.swiglu_limit = float(limit->value);

  if (act && act->value != "swigluoai") r.bad(*act, "only \"swigluoai\" is supported");
  if (gemma_norm && !gemma_norm->value) r.bad(*gemma_norm, "must be true (Gemma RMSNorm, scale 1 + w)");
  if (fusion && fusion->value) r.bad(*fusion, "hybrid context fusion is not supported");

  check_layer_types(r, layers, c.sliding_window);

  c.quant = read_quant(r);
  if (c.quant == DsparkQuant::kMxfp8) {
    for (const Found<int>* f : {&hidden, &ffn})
      if (f->value % 32 != 0) r.bad(*f, "must be a multiple of 32 with mxfp8 (the scale blocks)");
  }
  return c;
}

DsparkConfig read_dspark_config(const std::string& path) {
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!f) throw Error(path + ": cannot open: " + std::strerror(errno));
  std::string text;
  char buf[1 << 14];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof(buf), f.get())) > 0) text.append(buf, n);
  // fopen succeeds on a directory on some systems; the read is what fails then.
  if (std::ferror(f.get())) throw Error(path + ": cannot read: " + std::strerror(errno));
  return parse_dspark_config(text, path);
}

std::string dspark_config_json(const DsparkConfig& c) {
  const std::string what = "dspark_config_json";
  auto number = [&](const char* name, double v) {
    if (!std::isfinite(v)) throw Error(what + ": " + name + " = " + show(v) + ": not a finite number");
    return Json::number(v);  // float -> double is exact, and 17 digits read back to the same double
  };
  std::vector<Json> ids;
  for (int id : c.target_layer_ids) ids.push_back(Json::integer(id));
  std::vector<std::pair<std::string, Json>> m = {
      {"architectures", Json::array({Json::string("DSparkMiniMaxDraftModel")})},
      {"num_hidden_layers", Json::integer(c.num_layers)},
      {"hidden_size", Json::integer(c.hidden_size)},
      {"num_attention_heads", Json::integer(c.num_heads)},
      {"num_key_value_heads", Json::integer(c.num_kv_heads)},
      {"head_dim", Json::integer(c.head_dim)},
      {"dspark_ffn_hidden_size", Json::integer(c.ffn_size)},
      {"vocab_size", Json::integer(c.vocab_size)},
      {"dspark_block_size", Json::integer(c.block_size)},
      {"dspark_noise_token_id", Json::integer(c.mask_token_id)},
      {"dspark_target_layer_ids", Json::array(std::move(ids))},
      {"dspark_markov_rank", Json::integer(c.markov_rank)},
      {"dspark_markov_head_type", Json::string(c.markov_head_type)},
      {"enable_confidence_head", Json::boolean(c.confidence_head)},
      {"confidence_head_with_markov", Json::boolean(c.confidence_with_markov)},
      {"sliding_window", Json::integer(c.sliding_window)},
      {"rms_norm_eps", number("rms_norm_eps", c.rms_norm_eps)},
      {"rope_theta", number("rope_theta", c.rope_theta)},
      {"rotary_dim", Json::integer(c.rotary_dim)},
      {"swiglu_alpha", number("swiglu_alpha", c.swiglu_alpha)},
      {"swiglu_beta", number("swiglu_beta", c.swiglu_beta)},
      {"swiglu_limit", number("swiglu_limit", c.swiglu_limit)},
      {"max_position_embeddings", Json::integer(c.max_position_embeddings)},
      {"hidden_act", Json::string("swigluoai")},
      {"use_gemma_norm", Json::boolean(true)},
  };
  if (c.quant == DsparkQuant::kMxfp8)
    m.emplace_back("quantization_config",
                   Json::object({{"quant_method", Json::string("mxfp8")},
                                 {"weight_block_size", Json::array({Json::integer(1), Json::integer(32)})}}));
  std::string text = Json::object(std::move(m)).dump();
  // Read back before it is returned: a config the reader refuses must not end up in a checkpoint.
  parse_dspark_config(text, what);
  return text;
}

}  // namespace m3rt
