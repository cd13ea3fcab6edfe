#include "tools/cli.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <iostream>

#include "shardpoint/base/bytes.h"
#include "shardpoint/checkpoint.h"

namespace sp::cli {

std::string Args::Get(const std::string& name, const std::string& fallback) const {
  auto it = options.find(name);
  return it == options.end() ? fallback : it->second;
}

Result<Args> ParseArgs(const std::vector<std::string>& argv, const std::vector<std::string>& flags,
                       const std::vector<std::string>& valued) {
  Args args;
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    if (!a.starts_with("--") || a == "--") {
      args.positional.push_back(a);
      continue;
    }
    std::string name = a.substr(2);
    std::string value;
    bool has_inline = false;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_inline = true;
    }
    if (std::find(flags.begin(), flags.end(), name) != flags.end()) {
      args.options[name] = "";
    } else if (std::find(valued.begin(), valued.end(), name) != valued.end()) {
      if (!has_inline) {
        if (i + 1 >= argv.size()) return InvalidArgumentError("option --" + name + " needs a value");
        value = argv[++i];
      }
      args.options[name] = value;
    } else {
      return InvalidArgumentError("unknown option --" + name);
    }
  }
  return args;
}

Result<std::unique_ptr<Store>> StoreFor(const Args& args, std::string_view path) {
  return OpenStore(path, PosixStoreOptions{.allow_external_links = args.Has(kLinksFlag)});
}

int Fail(std::string_view verb, const Status& status) {
  std::cerr << "shardpoint " << verb << ": " << status.message() << "\n";
  return kExitFailure;
}

int UsageError(std::string_view verb, std::string_view message, std::string_view usage) {
  std::cerr << "shardpoint " << verb << ": " << message << "\n\n" << usage;
  return kExitUsage;
}

Result<int64_t> ParseInt(std::string_view option, std::string_view text, int64_t min,
                         int64_t max) {
  int64_t value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || value < min || value > max) {
    return InvalidArgumentError("--" + std::string(option) + " expects a whole number from " +
                                std::to_string(min) + " to " + std::to_string(max) + ", not '" +
                                std::string(text) + "'");
  }
  return value;
}

std::string JsonQuote(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

void DrawProgressBar(std::string_view label, uint64_t done, uint64_t total) {
  constexpr int kWidth = 30;
  const int filled = total == 0 ? kWidth : static_cast<int>(kWidth * std::min(done, total) / total);
  std::fprintf(stderr, "\r%.*s [%s%s] %s / %s", static_cast<int>(label.size()), label.data(),
               std::string(filled, '#').c_str(), std::string(kWidth - filled, '.').c_str(),
               HumanBytes(done).c_str(), HumanBytes(total).c_str());
  if (done >= total) std::fprintf(stderr, "\n");
  std::fflush(stderr);
}

}  // namespace sp::cli
