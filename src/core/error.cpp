#include "m3rt/error.h"

namespace m3rt {

void throw_arg_error(std::string_view op, std::string_view arg, std::string_view value,
                     std::string_view supported) {
  std::string msg;
  msg.reserve(op.size() + arg.size() + value.size() + supported.size() + 8);
  msg.append(op).append(": ").append(arg).append(" = ").append(value).append(": ").append(supported);
  throw Error(msg);
}

}  // namespace m3rt
