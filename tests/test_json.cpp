// The strict JSON reader and writer (src/core/json.h): every value kind, the typed accessors and
// their errors, exact int64 handling, every class of parse error with its byte offset, escapes and
// UTF-8 (decoded, passed through, or rejected), the nesting limit, and dump() -> parse_json round
// trips over generated trees.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/json.h"
#include "m3rt/error.h"

namespace {

using m3rt::detail::Json;
using m3rt::detail::parse_json;
using Members = std::vector<std::pair<std::string, Json>>;

Json parse(std::string_view text) { return parse_json(text, "doc"); }

// The message of the m3rt::Error that `f` throws ("" and a test failure when it throws none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const m3rt::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no m3rt::Error thrown";
  return "";
}

std::string parse_error(std::string_view text) {
  return error_of([&] { parse(text); });
}

// Asserts that parsing `text` fails at byte `offset` with a message containing `problem`.
void expect_parse_error(std::string_view text, size_t offset, const std::string& problem) {
  SCOPED_TRACE("input: '" + std::string(text) + "'");
  EXPECT_THROW(parse(text), m3rt::Error);
  const std::string msg = parse_error(text);
  const std::string prefix = "doc: JSON error at byte " + std::to_string(offset) + ": ";
  EXPECT_EQ(msg.rfind(prefix, 0), 0u) << msg;
  EXPECT_NE(msg.find(problem), std::string::npos) << msg;
}

bool is_integer(const Json& j) {
  try {
    j.as_int("");
    return true;
  } catch (const m3rt::Error&) {
    return false;
  }
}

// Structural equality: same kinds, same values (numbers: same integer-ness, same int64 when
// integers, same double bits otherwise, so -0.0 differs from 0.0), same member order.
void expect_same(const Json& a, const Json& b, const std::string& where = "$") {
  ASSERT_EQ(a.kind(), b.kind()) << where;
  switch (a.kind()) {
    case Json::Kind::kNull: break;
    case Json::Kind::kBool: EXPECT_EQ(a.as_bool(""), b.as_bool("")) << where; break;
    case Json::Kind::kNumber: {
      ASSERT_EQ(is_integer(a), is_integer(b)) << where;
      if (is_integer(a)) {
        EXPECT_EQ(a.as_int(""), b.as_int("")) << where;
      } else {
        const double x = a.as_double(""), y = b.as_double("");
        EXPECT_EQ(std::memcmp(&x, &y, sizeof(double)), 0) << where << ": " << x << " vs " << y;
      }
      break;
    }
    case Json::Kind::kString: EXPECT_EQ(a.as_string(""), b.as_string("")) << where; break;
    case Json::Kind::kArray: {
      const auto& x = a.as_array("");
      const auto& y = b.as_array("");
      ASSERT_EQ(x.size(), y.size()) << where;
      for (size_t i = 0; i < x.size(); ++i) expect_same(x[i], y[i], where + "[" + std::to_string(i) + "]");
      break;
    }
    case Json::Kind::kObject: {
      const auto& x = a.as_object("");
      const auto& y = b.as_object("");
      ASSERT_EQ(x.size(), y.size()) << where;
      for (size_t i = 0; i < x.size(); ++i) {
        ASSERT_EQ(x[i].first, y[i].first) << where;
        expect_same(x[i].second, y[i].second, where + "." + x[i].first);
      }
      break;
    }
  }
}

std::string nested_arrays(int depth) {
  return std::string(size_t(depth), '[') + std::string(size_t(depth), ']');
}

// ---- values -------------------------------------------------------------------------------------

TEST(Json, Scalars) {
  EXPECT_TRUE(parse("null").is_null());
  EXPECT_TRUE(parse("true").as_bool("t"));
  EXPECT_FALSE(parse("false").as_bool("f"));
  EXPECT_EQ(parse("0").as_int("n"), 0);
  EXPECT_EQ(parse("-17").as_int("n"), -17);
  EXPECT_EQ(parse("-17").as_double("n"), -17.0);
  EXPECT_EQ(parse("1.5").as_double("n"), 1.5);
  EXPECT_EQ(parse("2.5e-3").as_double("n"), 2.5e-3);
  EXPECT_EQ(parse("1E2").as_double("n"), 100.0);
  EXPECT_EQ(parse("\"hi\"").as_string("s"), "hi");
  EXPECT_EQ(parse("\"\"").as_string("s"), "");
  EXPECT_TRUE(parse("[]").as_array("a").empty());
  EXPECT_TRUE(parse("{}").as_object("o").empty());
  EXPECT_TRUE(parse(" \t\r\n null \n\t\r ").is_null());

  const Json n = parse("42");
  EXPECT_TRUE(n.is_number());
  EXPECT_FALSE(n.is_null() || n.is_bool() || n.is_string() || n.is_array() || n.is_object());
  EXPECT_EQ(n.kind(), Json::Kind::kNumber);
}

TEST(Json, KindNames) {
  EXPECT_STREQ(Json::kind_name(Json::Kind::kNull), "null");
  EXPECT_STREQ(Json::kind_name(Json::Kind::kBool), "boolean");
  EXPECT_STREQ(Json::kind_name(Json::Kind::kNumber), "number");
  EXPECT_STREQ(Json::kind_name(Json::Kind::kString), "string");
  EXPECT_STREQ(Json::kind_name(Json::Kind::kArray), "array");
  EXPECT_STREQ(Json::kind_name(Json::Kind::kObject), "object");
}

TEST(Json, NestedStructures) {
  const Json j = parse(R"( { "a" : [ 1 , { "b" : null , "c" : [ [ ] , { } ] } ] , "d" : { "e" : "f" } } )");
  const auto& a = j.find("a")->as_array("a");
  ASSERT_EQ(a.size(), 2u);
  EXPECT_EQ(a[0].as_int("a[0]"), 1);
  EXPECT_TRUE(a[1].find("b")->is_null());
  const auto& c = a[1].find("c")->as_array("c");
  ASSERT_EQ(c.size(), 2u);
  EXPECT_TRUE(c[0].as_array("").empty());
  EXPECT_TRUE(c[1].as_object("").empty());
  EXPECT_EQ(j.find("d")->find("e")->as_string("e"), "f");
}

TEST(Json, ObjectMembersInDocumentOrder) {
  const Json j = parse(R"({"z":1,"a":2,"m":3,"b":4})");
  const auto& m = j.as_object("o");
  ASSERT_EQ(m.size(), 4u);
  const char* want[] = {"z", "a", "m", "b"};
  for (size_t i = 0; i < m.size(); ++i) {
    EXPECT_EQ(m[i].first, want[i]);
    EXPECT_EQ(m[i].second.as_int(""), int64_t(i) + 1);
  }
}

TEST(Json, Find) {
  const Json j = parse(R"({"a":1,"":2,"a\u0000b":3})");
  ASSERT_NE(j.find("a"), nullptr);
  EXPECT_EQ(j.find("a")->as_int(""), 1);
  EXPECT_EQ(j.find("")->as_int(""), 2);
  EXPECT_EQ(j.find(std::string_view("a\0b", 3))->as_int(""), 3);
  EXPECT_EQ(j.find("b"), nullptr);
  EXPECT_EQ(j.find("A"), nullptr);
  // Not an object: nothing is found, nothing is thrown.
  EXPECT_EQ(parse(R"(["a"])").find("a"), nullptr);
  EXPECT_EQ(parse("\"a\"").find("a"), nullptr);
  EXPECT_EQ(Json::null().find("a"), nullptr);
}

TEST(Json, LargeObject) {
  std::string text = "{";
  for (int i = 0; i < 2000; ++i) text += (i ? ",\"t" : "\"t") + std::to_string(i) + "\":" + std::to_string(i);
  text += "}";
  const Json j = parse(text);
  ASSERT_EQ(j.as_object("").size(), 2000u);
  EXPECT_EQ(j.find("t1999")->as_int(""), 1999);
  EXPECT_EQ(j.as_object("")[1234].first, "t1234");
}

// ---- typed accessors ----------------------------------------------------------------------------

TEST(Json, AccessorKindErrors) {
  const Json values[] = {parse("null"), parse("true"), parse("1"), parse("\"s\""), parse("[]"), parse("{}")};
  const char* with_article[] = {"a null", "a boolean", "a number", "a string", "an array", "an object"};
  for (int have = 0; have < 6; ++have) {
    const Json& v = values[have];
    auto check = [&](int want, auto&& access) {
      if (want == have) return;
      const std::string msg = error_of(access);
      EXPECT_EQ(msg, std::string("config.json: x: is ") + with_article[have] + ", expected " +
                         with_article[want]);
    };
    check(1, [&] { v.as_bool("config.json: x"); });
    check(2, [&] { v.as_double("config.json: x"); });
    check(2, [&] { v.as_int("config.json: x"); });
    check(3, [&] { v.as_string("config.json: x"); });
    check(4, [&] { v.as_array("config.json: x"); });
    check(5, [&] { v.as_object("config.json: x"); });
  }
  EXPECT_THROW(parse("\"1\"").as_int("p"), m3rt::Error);
}

TEST(Json, AsIntExact) {
  EXPECT_EQ(parse("9223372036854775807").as_int("n"), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(parse("-9223372036854775808").as_int("n"), std::numeric_limits<int64_t>::min());
  EXPECT_EQ(parse("9007199254740993").as_int("n"), int64_t(9007199254740993));  // 2^53 + 1
  EXPECT_EQ(parse("-0").as_int("n"), 0);
  EXPECT_EQ(parse("[0, -1, 123456789012]").as_array("")[2].as_int("n"), int64_t(123456789012));

  // Refused, still usable as doubles.
  const std::pair<const char*, const char*> refused[] = {
      {"9223372036854775808", "9.2233720368547758e+18"},
      {"-9223372036854775809", "-9.2233720368547758e+18"},
      {"100000000000000000000000", "9.9999999999999992e+22"},
      {"1.0", "1.0"},
      {"1e3", "1000.0"},
      {"1E0", "1.0"},
      {"1.5", "1.5"},
      {"-2.0e-1", "-0.20000000000000001"},
  };
  for (const auto& [text, dumped] : refused) {
    SCOPED_TRACE(text);
    const Json j = parse(text);
    EXPECT_TRUE(j.is_number());
    EXPECT_EQ(j.as_double("n"), std::stod(text));
    const std::string msg = error_of([&] { j.as_int("cfg: n"); });
    EXPECT_EQ(msg, std::string("cfg: n: ") + dumped + " is not an integer (or out of int64 range)");
  }
}

TEST(Json, Doubles) {
  EXPECT_EQ(parse("1.5").as_double(""), 1.5);
  const double neg_zero = parse("-0.0").as_double("");
  EXPECT_EQ(neg_zero, 0.0);
  EXPECT_TRUE(std::signbit(neg_zero));
  EXPECT_EQ(parse("1e308").as_double(""), 1e308);
  EXPECT_EQ(parse("-1.7976931348623157e308").as_double(""), -1.7976931348623157e308);
  EXPECT_EQ(parse("4.9406564584124654e-324").as_double(""), 4.9406564584124654e-324);
  EXPECT_EQ(parse("0.1").as_double(""), 0.1);
  EXPECT_EQ(parse("123456789.125e-2").as_double(""), 1234567.89125);
  // Underflow is not an error: the value rounds to (signed) zero.
  EXPECT_EQ(parse("1e-400").as_double(""), 0.0);
  EXPECT_TRUE(std::signbit(parse("-1e-400").as_double("")));
  EXPECT_EQ(parse("0.0000000000000000000000000000000000000001e-300").as_double(""), 0.0);
  EXPECT_EQ(parse("0e999999999999999999999").as_double(""), 0.0);
  // Integers too large for int64 are still numbers.
  EXPECT_EQ(parse("18446744073709551616").as_double(""), 18446744073709551616.0);

  expect_parse_error("1e309", 0, "number out of range");
  expect_parse_error("-1e309", 0, "number out of range");
  expect_parse_error("[1, 1.8e308]", 4, "number out of range");
  expect_parse_error("0.00001e999999999999999999", 0, "number out of range");
  expect_parse_error(std::string(400, '9'), 0, "number out of range");
}

// ---- strings ------------------------------------------------------------------------------------

TEST(Json, StringEscapes) {
  EXPECT_EQ(parse(R"("\"\\\/\b\f\n\r\t")").as_string(""), "\"\\/\b\f\n\r\t");
  EXPECT_EQ(parse(R"("a\nb\tc")").as_string(""), "a\nb\tc");
  EXPECT_EQ(parse(R"("\u0041\u00e9\u20AC")").as_string(""), "A\xc3\xa9\xe2\x82\xac");
  EXPECT_EQ(parse(R"("\u007f\u0080\u07ff\u0800\uffff")").as_string(""),
            "\x7f\xc2\x80\xdf\xbf\xe0\xa0\x80\xef\xbf\xbf");
  EXPECT_EQ(parse(R"("x\u0000y")").as_string(""), std::string("x\0y", 3));
  // Surrogate pairs combine into one 4-byte sequence.
  EXPECT_EQ(parse(R"("\ud83d\ude00")").as_string(""), "\xf0\x9f\x98\x80");
  EXPECT_EQ(parse(R"("\uD800\uDC00")").as_string(""), "\xf0\x90\x80\x80");
  EXPECT_EQ(parse(R"("\udbff\udfff")").as_string(""), "\xf4\x8f\xbf\xbf");
}

TEST(Json, RawUtf8PassesThrough) {
  EXPECT_EQ(parse("\"é\"").as_string(""), "é");
  EXPECT_EQ(parse("\"h\xc3\xa9llo \xe2\x82\xac \xf0\x9f\x98\x80\"").as_string(""),
            "h\xc3\xa9llo \xe2\x82\xac \xf0\x9f\x98\x80");
  EXPECT_EQ(parse("\"\xf4\x8f\xbf\xbf\"").as_string(""), "\xf4\x8f\xbf\xbf");  // U+10FFFF
  // U+D7FF and U+E000, just outside the surrogate range.
  EXPECT_EQ(parse("\"\xed\x9f\xbf\xee\x80\x80\"").as_string(""), "\xed\x9f\xbf\xee\x80\x80");
  EXPECT_EQ(parse("\"\x7f\"").as_string(""), "\x7f");  // DEL is not a control character to JSON
  EXPECT_EQ(parse("{\"\xc3\xa9\":1}").find("\xc3\xa9")->as_int(""), 1);
}

TEST(Json, InvalidUtf8Rejected) {
  expect_parse_error("\"\xff\"", 1, "invalid UTF-8 byte 0xff");
  expect_parse_error("\"ab\xf5\x80\x80\x80\"", 3, "invalid UTF-8 byte 0xf5");
  expect_parse_error("\"\x80\"", 1, "invalid UTF-8 byte 0x80");
  expect_parse_error("\"\xc0\xaf\"", 1, "invalid UTF-8 byte 0xc0 (overlong encoding)");
  expect_parse_error("\"\xc1\xbf\"", 1, "overlong encoding");
  expect_parse_error("\"\xe0\x80\xaf\"", 1, "invalid UTF-8 sequence 0xe0 0x80 (overlong encoding)");
  expect_parse_error("\"\xf0\x8f\xbf\xbf\"", 1, "overlong encoding");
  expect_parse_error("\"\xed\xa0\x80\"", 1, "surrogate");
  expect_parse_error("\"\xed\xbf\xbf\"", 1, "surrogate");
  expect_parse_error("\"\xf4\x90\x80\x80\"", 1, "above U+10FFFF");
  expect_parse_error("\"\xc3(\"", 2, "invalid UTF-8 byte 0x28 (expected a continuation byte)");
  expect_parse_error("\"\xe2\x82\"", 3, "invalid UTF-8 byte 0x22");
  expect_parse_error("\"\xf0\x9f\x98\"", 4, "expected a continuation byte");
  expect_parse_error("\"\xe2\x82", 3, "unterminated string");
  expect_parse_error("{\"\xff\":1}", 2, "invalid UTF-8 byte 0xff");
  // Outside strings only ASCII syntax is valid.
  expect_parse_error("\xc3\xa9", 0, "expected a value, found byte 0xc3");
  expect_parse_error("\xef\xbb\xbf{}", 0, "byte 0xef");  // a byte order mark
}

// ---- parse errors -------------------------------------------------------------------------------

TEST(Json, EmptyAndWhitespaceOnlyRejected) {
  expect_parse_error("", 0, "unexpected end of input");
  expect_parse_error("   \n\t\r", 6, "unexpected end of input");
  const std::string msg = error_of([] { parse_json("", "model.safetensors header"); });
  EXPECT_EQ(msg,
            "model.safetensors header: JSON error at byte 0: unexpected end of input (expected a value)");
}

TEST(Json, TrailingCharactersRejected) {
  expect_parse_error("1 2", 2, "trailing characters after the value");
  expect_parse_error("{} x", 3, "trailing characters after the value");
  expect_parse_error("[1]]", 3, "trailing characters after the value");
  expect_parse_error("nullx", 4, "trailing characters after the value");
  expect_parse_error("\"a\"\"b\"", 3, "trailing characters after the value");
  expect_parse_error(std::string("1\0", 2), 1, "trailing characters after the value");
}

TEST(Json, UnexpectedEndOfInput) {
  expect_parse_error("[", 1, "unexpected end of input");
  expect_parse_error("[1,", 3, "unexpected end of input");
  expect_parse_error("{\"a\":1", 6, "unexpected end of input");
  expect_parse_error("{\"a\"", 4, "unexpected end of input (expected ':' after an object key)");
  expect_parse_error("{\"a\":", 5, "unexpected end of input (expected a value)");
  expect_parse_error("-", 1, "unexpected end of input");
  expect_parse_error("1.", 2, "unexpected end of input");
  expect_parse_error("1e+", 3, "unexpected end of input");
}

TEST(Json, SyntaxErrors) {
  expect_parse_error("{\"a\" 1}", 5, "expected ':' after an object key");
  expect_parse_error("{\"a\":1 \"b\":2}", 7, "expected ',' or '}' in an object");
  expect_parse_error("[1 2]", 3, "expected ',' or ']' in an array");
  expect_parse_error("{1:2}", 1, "expected an object key");
  expect_parse_error("{'a':1}", 1, "expected an object key");
  expect_parse_error("[1,]", 3, "trailing comma in an array");
  expect_parse_error("{\"a\":1,}", 7, "trailing comma in an object");
  expect_parse_error("[,1]", 1, "expected a value");
  expect_parse_error("tru", 0, "invalid literal");
  expect_parse_error("[nul]", 1, "invalid literal");
  expect_parse_error("True", 0, "expected a value, found 'T'");
  expect_parse_error("NaN", 0, "expected a value");
  expect_parse_error("Infinity", 0, "expected a value");
  expect_parse_error("-Infinity", 1, "expected a digit after '-'");
  expect_parse_error("// c\n1", 0, "expected a value");
  expect_parse_error("[1 /* c */]", 3, "expected ',' or ']' in an array");
  expect_parse_error("\f1", 0, "expected a value, found byte 0x0c");  // form feed is not whitespace
  expect_parse_error("\v1", 0, "expected a value");
}

TEST(Json, NumberErrors) {
  expect_parse_error("01", 0, "leading zero in a number");
  expect_parse_error("-012", 1, "leading zero in a number");
  expect_parse_error("[00]", 1, "leading zero in a number");
  expect_parse_error("+1", 0, "a number cannot start with '+'");
  expect_parse_error(".5", 0, "expected a value");
  expect_parse_error("1.e3", 2, "expected a digit after the decimal point");
  expect_parse_error("1.x", 2, "expected a digit after the decimal point");
  expect_parse_error("1e", 2, "expected a digit in the exponent");
  expect_parse_error("1e+x", 3, "expected a digit in the exponent");
  expect_parse_error("- 1", 1, "expected a digit after '-'");
  expect_parse_error("0x10", 1, "trailing characters after the value");
  // Leading zeros are fine where they are not the integer part.
  EXPECT_EQ(parse("0.001").as_double(""), 0.001);
  EXPECT_EQ(parse("1e007").as_double(""), 1e7);
}

TEST(Json, StringErrors) {
  expect_parse_error("\"abc", 4, "unterminated string (opened at byte 0)");
  expect_parse_error("[\"abc\\", 6, "unterminated string (opened at byte 1)");
  expect_parse_error("\"a\\qb\"", 2, "invalid escape \\q");
  expect_parse_error("\"\\x41\"", 1, "invalid escape \\x");
  expect_parse_error("\"\\'\"", 1, "invalid escape \\'");
  expect_parse_error(std::string("\"\\\x01\"", 4), 1, "invalid escape");
  expect_parse_error("\"a\nb\"", 2, "control character 0x0a in a string");
  expect_parse_error("\"\t\"", 1, "control character 0x09 in a string");
  expect_parse_error(std::string("\"\0\"", 3), 1, "control character 0x00 in a string");
  expect_parse_error("\"\x1f\"", 1, "control character 0x1f in a string");
  expect_parse_error("\"\\u12\"", 1, "invalid \\u escape: expected 4 hex digits");
  expect_parse_error("\"\\u12G4\"", 1, "invalid \\u escape");
  expect_parse_error("\"\\u12", 1, "invalid \\u escape");
  expect_parse_error("\"\\U0041\"", 1, "invalid escape \\U");
}

TEST(Json, LoneSurrogatesRejected) {
  expect_parse_error(R"("\ud800")", 1, "lone surrogate \\ud800");
  expect_parse_error(R"("ab\uD800x")", 3, "lone surrogate \\ud800");
  expect_parse_error(R"("\udbff\u0041")", 1, "lone surrogate \\udbff");
  expect_parse_error(R"("\ud800\ud800")", 1, "lone surrogate \\ud800");
  expect_parse_error(R"("\ud800\n")", 1, "lone surrogate \\ud800");
  expect_parse_error(R"("\udc00")", 1, "lone surrogate \\udc00");
  expect_parse_error(R"("\ude00\ud83d")", 1, "lone surrogate \\ude00");
  expect_parse_error(R"("\ud800\u12")", 7, "invalid \\u escape");
}

TEST(Json, DuplicateKeysRejected) {
  expect_parse_error(R"({"a":1,"a":2})", 7, "duplicate key \"a\"");
  expect_parse_error(R"({"a":{"b":1,"c":2,"b":3}})", 18, "duplicate key \"b\"");
  // Escapes decode before the comparison.
  expect_parse_error(R"({"a":1,"\u0061":2})", 7, "duplicate key \"a\"");
  expect_parse_error("{\"x\\ny\":1,\"x\\ny\":2}", 10, "duplicate key \"x\\ny\"");
  // The same key in different objects is fine.
  EXPECT_NO_THROW(parse(R"({"a":{"a":1},"b":{"a":2}})"));

  // Large objects (hashed lookup): a repeat of an early key, of a late key, and of the newest.
  // Keys are "k0", "k1", ...; the last one is "k<last>".
  auto big = [](int n, int last) {
    std::string s = "{";
    for (int i = 0; i < n; ++i) s.append("\"k").append(std::to_string(i)).append("\":0,");
    s.append("\"k").append(std::to_string(last)).append("\":1}");
    return s;
  };
  EXPECT_NO_THROW(parse(big(100, 100)));
  for (int n = 1; n < 40; ++n) {
    for (int last : {0, n / 2, n - 1}) {
      const std::string text = big(n, last);
      const std::string key = "\"k" + std::to_string(last) + "\"";
      expect_parse_error(text, text.rfind(",\"") + 1, "duplicate key " + key);
    }
  }
  for (int last : {0, 15, 16, 17, 99}) {
    const std::string text = big(100, last);
    expect_parse_error(text, text.rfind(",\"") + 1, "duplicate key \"k" + std::to_string(last) + "\"");
  }
}

TEST(Json, NestingLimit) {
  EXPECT_NO_THROW(parse(nested_arrays(128)));
  expect_parse_error(nested_arrays(129), 128, "nesting deeper than 128");
  expect_parse_error(nested_arrays(1000), 128, "nesting deeper than 128");

  std::string objects;
  for (int i = 0; i < 128; ++i) objects += "{\"a\":";
  EXPECT_NO_THROW(parse(objects + "1" + std::string(128, '}')));
  const std::string too_deep = objects + "{\"a\":1}" + std::string(128, '}');
  expect_parse_error(too_deep, objects.size(), "nesting deeper than 128");

  // Depth counts containers only; mixed.
  std::string mixed;
  for (int i = 0; i < 64; ++i) mixed += "[{\"k\":";
  mixed += "0";
  for (int i = 0; i < 64; ++i) mixed += "}]";
  EXPECT_NO_THROW(parse(mixed));
  EXPECT_THROW(parse("[" + mixed + "]"), m3rt::Error);
}

// ---- dump ---------------------------------------------------------------------------------------

TEST(Json, DumpCompact) {
  const Json j = Json::object({{"a", Json::integer(1)},
                               {"b", Json::array({Json::null(), Json::boolean(true), Json::boolean(false),
                                                  Json::number(1.5), Json::string("x\"\\/\n\x01\x1f\x7f")})},
                               {"c", Json::object({})},
                               {"\xc3\xa9", Json::array({})}});
  EXPECT_EQ(j.dump(), "{\"a\":1,\"b\":[null,true,false,1.5,\"x\\\"\\\\/\\n\\u0001\\u001f\x7f\"],\"c\":{},"
                      "\"\xc3\xa9\":[]}");
  EXPECT_EQ(Json::string("\b\f\r\t").dump(), R"("\b\f\r\t")");
  EXPECT_EQ(Json::integer(std::numeric_limits<int64_t>::min()).dump(), "-9223372036854775808");
  EXPECT_EQ(Json::integer(std::numeric_limits<int64_t>::max()).dump(), "9223372036854775807");
  EXPECT_EQ(parse("9007199254740993").dump(), "9007199254740993");
  // Non-integers keep a '.' or an exponent, so they read back as non-integers.
  EXPECT_EQ(Json::number(3.0).dump(), "3.0");
  EXPECT_EQ(Json::number(-0.0).dump(), "-0.0");
  EXPECT_EQ(Json::number(0.1).dump(), "0.10000000000000001");
  EXPECT_EQ(Json::number(1e20).dump(), "1e+20");
  EXPECT_EQ(Json::number(-2.5e-300).dump(), "-2.5e-300");
  EXPECT_EQ(parse("1e3").dump(), "1000.0");
  EXPECT_EQ(parse(" [ 1 , { \"a\" : null } ] ").dump(), "[1,{\"a\":null}]");
}

TEST(Json, NumberBuilderRefusesNonFinite) {
  EXPECT_THROW(Json::number(std::numeric_limits<double>::quiet_NaN()), m3rt::Error);
  EXPECT_THROW(Json::number(std::numeric_limits<double>::infinity()), m3rt::Error);
  EXPECT_THROW(Json::number(-std::numeric_limits<double>::infinity()), m3rt::Error);
  const double max = std::numeric_limits<double>::max();
  EXPECT_EQ(Json::number(max).as_double(""), max);
}

// Trees with every kind, awkward numbers (random finite bit patterns, int64 edges) and strings
// (control characters, quotes, backslashes, every UTF-8 length).
class TreeGen {
 public:
  explicit TreeGen(uint64_t seed) : rng_(seed) {}

  Json value(int depth) {
    switch (pick(depth < 6 ? 7 : 5)) {
      case 0: return Json::null();
      case 1: return Json::boolean(pick(2) == 1);
      case 2: return integer();
      case 3: return number();
      case 4: return Json::string(text());
      case 5: {
        std::vector<Json> items;
        for (int i = 0, n = pick(5); i < n; ++i) items.push_back(value(depth + 1));
        return Json::array(std::move(items));
      }
      default: {
        Members members;
        // The "#i" suffix keeps keys unique.
        for (int i = 0, n = pick(5); i < n; ++i) {
          members.emplace_back(text() + "#" + std::to_string(i), value(depth + 1));
        }
        return Json::object(std::move(members));
      }
    }
  }

 private:
  int pick(int n) { return int(rng_() % uint64_t(n)); }

  Json integer() {
    const int64_t edges[] = {0, 1, -1, std::numeric_limits<int64_t>::max(),
                             std::numeric_limits<int64_t>::min(), int64_t(1) << 53, -(int64_t(1) << 53) - 1};
    if (pick(2)) return Json::integer(edges[pick(7)]);
    return Json::integer(static_cast<int64_t>(rng_()) >> pick(64));
  }

  Json number() {
    const double edges[] = {0.0, -0.0, 3.0, 0.1, 1e300, -1e-300, 5e-324, std::numeric_limits<double>::max(),
                            std::numeric_limits<double>::min(), 9007199254740993.0};
    if (pick(2)) return Json::number(edges[pick(10)]);
    for (;;) {
      const uint64_t bits = rng_();
      double d;
      std::memcpy(&d, &bits, sizeof(d));
      if (std::isfinite(d)) return Json::number(d);
    }
  }

  std::string text() {
    static const char* const pieces[] = {"a", "Z", " ", "\"", "\\", "/", "\n", "\t", "\x01", "\x1f", "\x7f",
                                         "\xc3\xa9", "\xe2\x82\xac", "\xef\xbf\xbf", "\xf0\x9f\x98\x80",
                                         "\xf4\x8f\xbf\xbf"};
    std::string s;
    for (int i = 0, n = pick(8); i < n; ++i) {
      const int k = pick(17);
      if (k == 16) {
        s += '\0';
      } else {
        s += pieces[k];
      }
    }
    return s;
  }

  std::mt19937_64 rng_;
};

size_t count_nodes(const Json& j) {
  size_t n = 1;
  if (j.is_array())
    for (const Json& item : j.as_array("")) n += count_nodes(item);
  if (j.is_object())
    for (const auto& m : j.as_object("")) n += count_nodes(m.second);
  return n;
}

TEST(Json, DumpRoundTrips) {
  size_t nodes = 0;
  for (uint64_t seed = 1; seed <= 200; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    TreeGen gen(seed);
    Members root;
    for (int i = 0; i < 6; ++i) root.emplace_back(std::string(1, 'm').append(std::to_string(i)), gen.value(0));
    const Json tree = Json::object(std::move(root));
    nodes += count_nodes(tree);
    const std::string text = tree.dump();
    const Json back = parse(text);
    expect_same(tree, back);
    EXPECT_EQ(back.dump(), text);
    if (HasFailure()) break;
  }
  EXPECT_GT(nodes, 2000u);  // the generator makes real trees, not mostly scalars
}

TEST(Json, ParseDumpParse) {
  const char* docs[] = {
      R"({"__metadata__":{"format":"pt"},)"
      R"("w":{"dtype":"BF16","shape":[4096,11008],"data_offsets":[0,90177536]}})",
      R"([1,-0,-0.0,1.0,1e3,1E-3,0.5,123456789012345678,1.7976931348623157e308,5e-324,"\u00e9\ud83d\ude00"])",
      R"({"a":[[],{},[{}],"",null,true,false]})",
  };
  for (const char* doc : docs) {
    SCOPED_TRACE(doc);
    const Json j = parse(doc);
    expect_same(j, parse(j.dump()));
  }
}

}  // namespace
