// Strict JSON reading and compact writing; rules and API: json.h.
#include "core/json.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <functional>
#include <system_error>
#include <unordered_set>

#include "m3rt/error.h"

namespace m3rt::detail {

namespace {

constexpr int kMaxDepth = 128;
// Objects with more members than this check duplicate keys with a hash set instead of a scan
// (safetensors headers hold one member per tensor, thousands in large shards).
constexpr size_t kLinearKeyScan = 16;

bool is_digit(char c) { return c >= '0' && c <= '9'; }

std::string hex_byte(unsigned char b) {
  static const char kHex[] = "0123456789abcdef";
  return std::string("0x") + kHex[b >> 4] + kHex[b & 15];
}

// How a byte is named in an error: printable ASCII quoted, anything else in hex.
std::string describe_byte(char c) {
  const auto b = static_cast<unsigned char>(c);
  if (b > 0x20 && b < 0x7f) return std::string("'") + c + "'";
  return "byte " + hex_byte(b);
}

void append_escaped(std::string& out, std::string_view s) {
  static const char kHex[] = "0123456789abcdef";
  out += '"';
  size_t run = 0;  // start of the pending run of bytes that need no escape
  for (size_t i = 0; i < s.size(); ++i) {
    const auto b = static_cast<unsigned char>(s[i]);
    if (b >= 0x20 && b != '"' && b != '\\') continue;
    out.append(s.data() + run, i - run);
    run = i + 1;
    switch (b) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        out += "\\u00";
        out += kHex[b >> 4];
        out += kHex[b & 15];
    }
  }
  out.append(s.data() + run, s.size() - run);
  out += '"';
}

// A non-integer number with 17 significant digits. When that text has no '.' or exponent (3.0 prints
// as "3") ".0" is appended, so that it parses back as a non-integer and as_int keeps refusing it.
void append_double(std::string& out, double v) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::general, 17);
  const std::string_view text(buf, size_t(r.ptr - buf));
  out += text;
  if (text.find_first_of(".e") == std::string_view::npos) out += ".0";
}

void append_int(std::string& out, int64_t v) {
  char buf[24];
  const auto r = std::to_chars(buf, buf + sizeof(buf), v);
  out.append(buf, size_t(r.ptr - buf));
}

[[noreturn]] void throw_kind_error(std::string_view path, Json::Kind is, Json::Kind expected) {
  // "an array" / "an object": the article follows the kind name.
  auto with_article = [](Json::Kind k) {
    const bool vowel = k == Json::Kind::kArray || k == Json::Kind::kObject;
    return std::string(vowel ? "an " : "a ") + Json::kind_name(k);
  };
  std::string msg(path);
  msg += ": is " + with_article(is) + ", expected " + with_article(expected);
  throw Error(msg);
}

}  // namespace

// ---- the tree -----------------------------------------------------------------------------------

const char* Json::kind_name(Kind k) {
  switch (k) {
    case Kind::kNull: return "null";
    case Kind::kBool: return "boolean";
    case Kind::kNumber: return "number";
    case Kind::kString: return "string";
    case Kind::kArray: return "array";
    case Kind::kObject: return "object";
  }
  return "?";
}

bool Json::as_bool(std::string_view path) const {
  if (kind_ != Kind::kBool) throw_kind_error(path, kind_, Kind::kBool);
  return bool_;
}

double Json::as_double(std::string_view path) const {
  if (kind_ != Kind::kNumber) throw_kind_error(path, kind_, Kind::kNumber);
  return num_;
}

int64_t Json::as_int(std::string_view path) const {
  if (kind_ != Kind::kNumber) throw_kind_error(path, kind_, Kind::kNumber);
  if (!is_int_) {
    std::string msg(path);
    msg += ": ";
    append_double(msg, num_);
    msg += " is not an integer (or out of int64 range)";
    throw Error(msg);
  }
  return int_;
}

const std::string& Json::as_string(std::string_view path) const {
  if (kind_ != Kind::kString) throw_kind_error(path, kind_, Kind::kString);
  return str_;
}

const std::vector<Json>& Json::as_array(std::string_view path) const {
  if (kind_ != Kind::kArray) throw_kind_error(path, kind_, Kind::kArray);
  return items_;
}

const std::vector<std::pair<std::string, Json>>& Json::as_object(std::string_view path) const {
  if (kind_ != Kind::kObject) throw_kind_error(path, kind_, Kind::kObject);
  return members_;
}

const Json* Json::find(std::string_view key) const {
  for (const auto& m : members_)  // empty unless this is an object
    if (m.first == key) return &m.second;
  return nullptr;
}

Json Json::boolean(bool b) {
  Json j;
  j.kind_ = Kind::kBool;
  j.bool_ = b;
  return j;
}

Json Json::number(double v) {
  // Refused here rather than in dump(): every tree that exists can be written as JSON.
  if (!std::isfinite(v)) throw Error("Json::number: NaN and infinities cannot be represented in JSON");
  Json j;
  j.kind_ = Kind::kNumber;
  j.num_ = v;
  return j;
}

Json Json::integer(int64_t v) {
  Json j;
  j.kind_ = Kind::kNumber;
  j.is_int_ = true;
  j.int_ = v;
  j.num_ = static_cast<double>(v);
  return j;
}

Json Json::string(std::string s) {
  Json j;
  j.kind_ = Kind::kString;
  j.str_ = std::move(s);
  return j;
}

Json Json::array(std::vector<Json> items) {
  Json j;
  j.kind_ = Kind::kArray;
  j.items_ = std::move(items);
  return j;
}

Json Json::object(std::vector<std::pair<std::string, Json>> members) {
  Json j;
  j.kind_ = Kind::kObject;
  j.members_ = std::move(members);
  return j;
}

// ---- the parser (and the writer) ---------------------------------------------------------------

// Recursive descent over the text; pos_ is the next unread byte. Json befriends this class (so it
// is not in the anonymous namespace), which is why the writer, which needs is_int_, lives here too.
class JsonParser {
 public:
  JsonParser(std::string_view text, std::string_view what) : s_(text), what_(what) {}

  static void write(std::string& out, const Json& j) {
    switch (j.kind_) {
      case Json::Kind::kNull: out += "null"; return;
      case Json::Kind::kBool: out += j.bool_ ? "true" : "false"; return;
      case Json::Kind::kNumber:
        if (j.is_int_) {
          append_int(out, j.int_);
        } else {
          append_double(out, j.num_);
        }
        return;
      case Json::Kind::kString: append_escaped(out, j.str_); return;
      case Json::Kind::kArray:
        out += '[';
        for (size_t i = 0; i < j.items_.size(); ++i) {
          if (i) out += ',';
          write(out, j.items_[i]);
        }
        out += ']';
        return;
      case Json::Kind::kObject:
        out += '{';
        for (size_t i = 0; i < j.members_.size(); ++i) {
          if (i) out += ',';
          append_escaped(out, j.members_[i].first);
          out += ':';
          write(out, j.members_[i].second);
        }
        out += '}';
        return;
    }
  }

  Json parse_document() {
    skip_ws();
    Json root = parse_value(0);
    skip_ws();
    if (pos_ != s_.size()) fail(pos_, "trailing characters after the value");
    return root;
  }

 private:
  using Member = std::pair<std::string, Json>;

  [[noreturn]] void fail(size_t at, const std::string& problem) const {
    std::string msg(what_);
    msg += ": JSON error at byte " + std::to_string(at) + ": " + problem;
    throw Error(msg);
  }

  // The byte at pos_ is not what the grammar allows here (or the input ended).
  [[noreturn]] void fail_expected(const char* expectation) const {
    if (pos_ >= s_.size()) fail(pos_, std::string("unexpected end of input (") + expectation + ")");
    fail(pos_, std::string(expectation) + ", found " + describe_byte(s_[pos_]));
  }

  [[noreturn]] void fail_unterminated(size_t open) const {
    fail(s_.size(), "unterminated string (opened at byte " + std::to_string(open) + ")");
  }

  bool at_end() const { return pos_ >= s_.size(); }
  bool peek_is(char c) const { return pos_ < s_.size() && s_[pos_] == c; }
  bool peek_digit() const { return pos_ < s_.size() && is_digit(s_[pos_]); }

  void skip_ws() {
    while (pos_ < s_.size()) {
      const char c = s_[pos_];
      if (c != ' ' && c != '\t' && c != '\n' && c != '\r') return;
      ++pos_;
    }
  }

  Json parse_value(int depth) {
    if (at_end()) fail_expected("expected a value");
    switch (s_[pos_]) {
      case '{': return parse_object(depth + 1);
      case '[': return parse_array(depth + 1);
      case '"': {
        Json j;
        j.kind_ = Json::Kind::kString;
        parse_string(j.str_);
        return j;
      }
      case 't': expect_literal("true"); return Json::boolean(true);
      case 'f': expect_literal("false"); return Json::boolean(false);
      case 'n': expect_literal("null"); return Json();
      case '+': fail(pos_, "a number cannot start with '+'");
      default:
        if (s_[pos_] == '-' || is_digit(s_[pos_])) return parse_number();
        fail_expected("expected a value");
    }
  }

  void expect_literal(std::string_view word) {
    if (s_.substr(pos_, word.size()) != word) {
      fail(pos_, "invalid literal (expected '" + std::string(word) + "')");
    }
    pos_ += word.size();
  }

  void enter(int depth) const {
    if (depth > kMaxDepth) fail(pos_, "nesting deeper than " + std::to_string(kMaxDepth));
  }

  Json parse_array(int depth) {
    enter(depth);
    ++pos_;  // '['
    Json j;
    j.kind_ = Json::Kind::kArray;
    skip_ws();
    if (peek_is(']')) {
      ++pos_;
      return j;
    }
    for (;;) {
      j.items_.push_back(parse_value(depth));
      skip_ws();
      if (peek_is(']')) {
        ++pos_;
        return j;
      }
      if (!peek_is(',')) fail_expected("expected ',' or ']' in an array");
      ++pos_;
      skip_ws();
      if (peek_is(']')) fail(pos_, "trailing comma in an array");
    }
  }

  Json parse_object(int depth) {
    enter(depth);
    ++pos_;  // '{'
    Json j;
    j.kind_ = Json::Kind::kObject;
    std::vector<Member>& members = j.members_;
    skip_ws();
    if (peek_is('}')) {
      ++pos_;
      return j;
    }
    // Hashes member indices (not views of the keys: moving a short std::string moves its bytes).
    auto hash = [&members](size_t i) { return std::hash<std::string>()(members[i].first); };
    auto equal = [&members](size_t a, size_t b) { return members[a].first == members[b].first; };
    std::unordered_set<size_t, decltype(hash), decltype(equal)> seen(0, hash, equal);
    for (;;) {
      if (!peek_is('"')) fail_expected("expected an object key (a string)");
      const size_t key_at = pos_;
      std::string key;
      parse_string(key);
      members.emplace_back(std::move(key), Json());
      if (is_duplicate(members, seen)) {
        std::string problem = "duplicate key ";
        append_escaped(problem, members.back().first);
        fail(key_at, problem);
      }
      skip_ws();
      if (!peek_is(':')) fail_expected("expected ':' after an object key");
      ++pos_;
      skip_ws();
      members.back().second = parse_value(depth);
      skip_ws();
      if (peek_is('}')) {
        ++pos_;
        return j;
      }
      if (!peek_is(',')) fail_expected("expected ',' or '}' in an object");
      ++pos_;
      skip_ws();
      if (peek_is('}')) fail(pos_, "trailing comma in an object");
    }
  }

  // Whether the key just appended to `members` repeats an earlier one. Small objects are scanned;
  // from kLinearKeyScan members on, `seen` holds every index.
  template <class Set>
  static bool is_duplicate(const std::vector<Member>& members, Set& seen) {
    const size_t last = members.size() - 1;
    if (members.size() <= kLinearKeyScan) {
      for (size_t i = 0; i < last; ++i)
        if (members[i].first == members[last].first) return true;
      return false;
    }
    if (seen.empty())
      for (size_t i = 0; i < last; ++i) seen.insert(i);
    return !seen.insert(last).second;
  }

  // Reads the string starting at the '"' at pos_ into `out` (escapes decoded).
  void parse_string(std::string& out) {
    const size_t open = pos_++;
    for (;;) {
      // Copy the run of bytes that need no attention in one append.
      const size_t run = pos_;
      while (pos_ < s_.size()) {
        const auto b = static_cast<unsigned char>(s_[pos_]);
        if (b < 0x20 || b == '"' || b == '\\' || b >= 0x80) break;
        ++pos_;
      }
      out.append(s_.data() + run, pos_ - run);
      if (at_end()) fail_unterminated(open);
      const auto b = static_cast<unsigned char>(s_[pos_]);
      if (b == '"') {
        ++pos_;
        return;
      }
      if (b == '\\') {
        parse_escape(out, open);
      } else if (b < 0x20) {
        fail(pos_, "control character " + hex_byte(b) + " in a string");
      } else {
        const size_t start = pos_;
        check_utf8_sequence(open);
        out.append(s_.data() + start, pos_ - start);
      }
    }
  }

  // One escape at pos_ (the backslash); appends its bytes to `out`.
  void parse_escape(std::string& out, size_t open) {
    const size_t at = pos_;
    if (pos_ + 1 >= s_.size()) fail_unterminated(open);
    const char c = s_[pos_ + 1];
    pos_ += 2;
    switch (c) {
      case '"': out += '"'; return;
      case '\\': out += '\\'; return;
      case '/': out += '/'; return;
      case 'b': out += '\b'; return;
      case 'f': out += '\f'; return;
      case 'n': out += '\n'; return;
      case 'r': out += '\r'; return;
      case 't': out += '\t'; return;
      case 'u': break;
      default: {
        const auto b = static_cast<unsigned char>(c);
        if (b > 0x20 && b < 0x7f) fail(at, std::string("invalid escape \\") + c);
        fail(at, "invalid escape: '\\' followed by byte " + hex_byte(b));
      }
    }
    uint32_t cp = read_hex4(at);
    if (cp >= 0xDC00 && cp <= 0xDFFF) fail(at, "lone surrogate " + u_escape(cp));
    if (cp >= 0xD800 && cp <= 0xDBFF) {
      // A high surrogate counts only with a low one escaped right after it.
      const size_t low_at = pos_;
      if (s_.substr(pos_, 2) != "\\u") fail(at, "lone surrogate " + u_escape(cp));
      pos_ += 2;
      const uint32_t low = read_hex4(low_at);
      if (low < 0xDC00 || low > 0xDFFF) fail(at, "lone surrogate " + u_escape(cp));
      cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
    }
    append_utf8(out, cp);
  }

  // The four hex digits at pos_ of the \u escape at `at`.
  uint32_t read_hex4(size_t at) {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i, ++pos_) {
      if (at_end()) fail(at, "invalid \\u escape: expected 4 hex digits");
      const char c = s_[pos_];
      uint32_t d;
      if (c >= '0' && c <= '9') {
        d = uint32_t(c - '0');
      } else if (c >= 'a' && c <= 'f') {
        d = uint32_t(c - 'a' + 10);
      } else if (c >= 'A' && c <= 'F') {
        d = uint32_t(c - 'A' + 10);
      } else {
        fail(at, "invalid \\u escape: expected 4 hex digits");
      }
      v = v * 16 + d;
    }
    return v;
  }

  static std::string u_escape(uint32_t cp) {
    static const char kHex[] = "0123456789abcdef";
    std::string s = "\\u";
    for (int shift = 12; shift >= 0; shift -= 4) s += kHex[(cp >> shift) & 15];
    return s;
  }

  static void append_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += char(cp);
    } else if (cp < 0x800) {
      out += char(0xC0 | (cp >> 6));
      out += char(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += char(0xE0 | (cp >> 12));
      out += char(0x80 | ((cp >> 6) & 0x3F));
      out += char(0x80 | (cp & 0x3F));
    } else {
      out += char(0xF0 | (cp >> 18));
      out += char(0x80 | ((cp >> 12) & 0x3F));
      out += char(0x80 | ((cp >> 6) & 0x3F));
      out += char(0x80 | (cp & 0x3F));
    }
  }

  // Checks the multi-byte UTF-8 sequence whose lead byte is at pos_ and moves past it. The ranges
  // allowed for the second byte exclude overlong forms (after E0, F0), UTF-16 surrogates
  // (after ED) and code points above U+10FFFF (after F4).
  void check_utf8_sequence(size_t open) {
    const size_t lead_at = pos_;
    const auto lead = static_cast<unsigned char>(s_[pos_]);
    int len = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    const char* range_problem = "";
    if (lead >= 0xC2 && lead <= 0xDF) {
      len = 2;
    } else if (lead >= 0xE0 && lead <= 0xEF) {
      len = 3;
      if (lead == 0xE0) {
        lo = 0xA0;
        range_problem = "overlong encoding";
      } else if (lead == 0xED) {
        hi = 0x9F;
        range_problem = "UTF-16 surrogate encoded in UTF-8";
      }
    } else if (lead >= 0xF0 && lead <= 0xF4) {
      len = 4;
      if (lead == 0xF0) {
        lo = 0x90;
        range_problem = "overlong encoding";
      } else if (lead == 0xF4) {
        hi = 0x8F;
        range_problem = "code point above U+10FFFF";
      }
    } else if (lead == 0xC0 || lead == 0xC1) {
      fail(pos_, "invalid UTF-8 byte " + hex_byte(lead) + " (overlong encoding)");
    } else {
      fail(pos_, "invalid UTF-8 byte " + hex_byte(lead));
    }
    ++pos_;
    for (int i = 1; i < len; ++i, ++pos_) {
      if (at_end()) fail_unterminated(open);
      const auto b = static_cast<unsigned char>(s_[pos_]);
      if (b < 0x80 || b > 0xBF) {
        fail(pos_, "invalid UTF-8 byte " + hex_byte(b) + " (expected a continuation byte)");
      }
      if (i == 1 && (b < lo || b > hi)) {
        fail(lead_at, "invalid UTF-8 sequence " + hex_byte(lead) + " " + hex_byte(b) + " (" +
                          range_problem + ")");
      }
    }
  }

  Json parse_number() {
    const size_t start = pos_;
    const bool negative = peek_is('-');
    if (negative) ++pos_;
    if (!peek_digit()) fail_expected("expected a digit after '-'");
    const size_t int_start = pos_;
    if (s_[pos_] == '0') {
      ++pos_;
      if (peek_digit()) fail(int_start, "leading zero in a number");
    } else {
      while (peek_digit()) ++pos_;
    }
    const size_t int_end = pos_;
    bool integer = true;
    if (peek_is('.')) {
      integer = false;
      ++pos_;
      if (!peek_digit()) fail_expected("expected a digit after the decimal point");
      while (peek_digit()) ++pos_;
    }
    if (peek_is('e') || peek_is('E')) {
      integer = false;
      ++pos_;
      if (peek_is('+') || peek_is('-')) ++pos_;
      if (!peek_digit()) fail_expected("expected a digit in the exponent");
      while (peek_digit()) ++pos_;
    }

    Json j;
    j.kind_ = Json::Kind::kNumber;
    if (integer) {
      // Exact digits, not via double: int64 values above 2^53 must come back unchanged.
      const uint64_t limit = negative ? uint64_t(1) << 63 : (uint64_t(1) << 63) - 1;
      uint64_t v = 0;
      bool fits = true;
      for (size_t i = int_start; i < int_end && fits; ++i) {
        const auto d = uint64_t(s_[i] - '0');
        if (v > (limit - d) / 10) fits = false;
        v = v * 10 + d;
      }
      if (fits) {
        j.is_int_ = true;
        j.int_ = static_cast<int64_t>(negative ? 0 - v : v);  // modular, so -2^63 is exact
        j.num_ = static_cast<double>(j.int_);
        return j;
      }
    }
    const std::string_view token = s_.substr(start, pos_ - start);
    double v = 0;
    const auto r = std::from_chars(token.data(), token.data() + token.size(), v);
    if (r.ec == std::errc::result_out_of_range) {
      // from_chars says this both for overflow and for underflow to zero; only overflow is an error.
      if (magnitude_at_least_one(token)) fail(start, "number out of range");
      v = negative ? -0.0 : 0.0;
    } else if (r.ec != std::errc() || r.ptr != token.data() + token.size() || !std::isfinite(v)) {
      fail(start, "number out of range");  // not expected for a token the grammar accepted
    }
    j.num_ = v;
    return j;
  }

  // Whether the number token (already checked against the grammar, not all zeros) is >= 1 in
  // magnitude: the decimal exponent of its first non-zero digit is >= 0.
  static bool magnitude_at_least_one(std::string_view t) {
    size_t i = t[0] == '-' ? 1 : 0;
    int64_t digits_before_point = 0, first_nonzero = -1, n = 0;  // n: digits seen so far
    bool after_point = false;
    for (; i < t.size() && t[i] != 'e' && t[i] != 'E'; ++i) {
      if (t[i] == '.') {
        after_point = true;
        continue;
      }
      if (first_nonzero < 0 && t[i] != '0') first_nonzero = n;
      ++n;
      if (!after_point) ++digits_before_point;
    }
    if (first_nonzero < 0) return false;
    int64_t exp = 0;
    if (i < t.size()) {
      ++i;
      const bool neg_exp = t[i] == '-';
      if (t[i] == '+' || t[i] == '-') ++i;
      for (; i < t.size(); ++i) exp = std::min<int64_t>(exp * 10 + (t[i] - '0'), int64_t(1) << 40);
      if (neg_exp) exp = -exp;
    }
    return digits_before_point - 1 - first_nonzero + exp >= 0;
  }

  std::string_view s_;
  std::string_view what_;
  size_t pos_ = 0;
};

std::string Json::dump() const {
  std::string out;
  JsonParser::write(out, *this);
  return out;
}

Json parse_json(std::string_view text, std::string_view what) {
  return JsonParser(text, what).parse_document();
}

}  // namespace m3rt::detail
