#include "os/exec.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "gpuipc/error.hpp"

namespace gpuipc::os {

void exec_replace(const std::vector<std::string>& argv) {
  if (argv.empty() || argv[0].empty() || argv[0][0] != '/') {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("exec: the program must be an absolute path, got '{}'",
                            argv.empty() ? std::string() : argv[0]),
                "execv", EINVAL);
  }
  std::vector<char*> args;
  args.reserve(argv.size() + 1);
  for (const std::string& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);
  ::execv(args[0], args.data());
  const int err = errno;
  throw Error(ErrorCode::System, fmt::format("cannot run {}: {} (errno {})", argv[0], std::strerror(err), err), "execv",
              err);
}

}  // namespace gpuipc::os
