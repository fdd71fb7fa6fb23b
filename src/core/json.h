// Internal: a strict JSON (RFC 8259) reader for the small documents m3rt reads — safetensors
// headers and model config.json files. The whole text is parsed into a tree; nothing is lazy.
//
// defines: Json, parse_json.
//
// Strict means: one value with optional surrounding whitespace (space, tab, CR, LF); no comments,
// no trailing commas, no NaN/Infinity, no leading zeros or '+', no unescaped control characters
// in strings; \uXXXX escapes (surrogate pairs combined, lone surrogates rejected) become UTF-8;
// invalid UTF-8 in the input is rejected; duplicate object keys are rejected; nesting deeper than
// 128 levels is rejected. Every error is an m3rt::Error naming `what` (the document, e.g.
// "model.safetensors header"), the byte offset and the problem, e.g.
//   "model.safetensors header: JSON error at byte 17: expected ':' after an object key".
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace m3rt::detail {

class Json {
 public:
  enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject };

  Kind kind() const { return kind_; }
  bool is_null() const { return kind_ == Kind::kNull; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_number() const { return kind_ == Kind::kNumber; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_array() const { return kind_ == Kind::kArray; }
  bool is_object() const { return kind_ == Kind::kObject; }
  // "null", "boolean", "number", "string", "array", "object".
  static const char* kind_name(Kind k);

  // Typed access; each throws m3rt::Error("<path>: is a <kind>, expected a <kind>") when the kind
  // differs. `path` is the caller's full name for this value (e.g. "config.json: hidden_size").
  bool as_bool(std::string_view path) const;
  double as_double(std::string_view path) const;
  // The number as an int64_t; throws when it is not an integer written without fraction or
  // exponent, or does not fit (e.g. 1.0, 1e3, 9223372036854775808 are refused).
  int64_t as_int(std::string_view path) const;
  const std::string& as_string(std::string_view path) const;
  const std::vector<Json>& as_array(std::string_view path) const;
  // Members in document order.
  const std::vector<std::pair<std::string, Json>>& as_object(std::string_view path) const;

  // Object lookup: the member named `key`, or nullptr (also nullptr when this is not an object).
  const Json* find(std::string_view key) const;

  // Builders (tests, writers).
  static Json null() { return Json(); }
  static Json boolean(bool b);
  static Json number(double v);
  static Json integer(int64_t v);
  static Json string(std::string s);
  static Json array(std::vector<Json> items);
  static Json object(std::vector<std::pair<std::string, Json>> members);

  // Compact serialization (no spaces); integers print exactly, other numbers with 17 significant
  // digits; strings escape '"', '\\' and control characters. parse_json(dump()) gives back an
  // equal tree.
  std::string dump() const;

 private:
  Kind kind_ = Kind::kNull;
  bool bool_ = false;
  bool is_int_ = false;  // a number written as an integer that fits int64_t
  int64_t int_ = 0;
  double num_ = 0;
  std::string str_;
  std::vector<Json> items_;
  std::vector<std::pair<std::string, Json>> members_;
  friend class JsonParser;
};

// Parses `text` (the whole document). Throws m3rt::Error naming `what` on any error.
Json parse_json(std::string_view text, std::string_view what);

}  // namespace m3rt::detail
