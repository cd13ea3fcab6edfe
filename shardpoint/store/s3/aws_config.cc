#include "shardpoint/store/s3/aws_config.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

namespace sp {
namespace {

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r')) {
    s.remove_prefix(1);
  }
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) {
    s.remove_suffix(1);
  }
  return s;
}

// The file at `path`, or nullopt when there is none.
Result<std::optional<std::string>> ReadIfPresent(const std::string& path) {
  std::error_code error;
  if (!std::filesystem::exists(path, error)) return std::optional<std::string>();
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  if (in) text << in.rdbuf();
  if (!in || in.bad()) return InvalidArgumentError("cannot read " + path);
  return std::optional<std::string>(text.str());
}

Result<IniFile> ReadIni(const std::string& path) {
  SP_ASSIGN_OR_RETURN(std::optional<std::string> text, ReadIfPresent(path));
  if (!text) return IniFile();
  return ParseAwsIni(*text, path);
}

// The value of `key` in section `section`, or nullopt.
std::optional<std::string> Get(const IniFile& ini, const std::string& section,
                               const std::string& key) {
  auto s = ini.find(section);
  if (s == ini.end()) return std::nullopt;
  auto k = s->second.find(key);
  if (k == s->second.end() || k->second.empty()) return std::nullopt;
  return k->second;
}

std::optional<std::string> NonEmpty(const EnvLookup& env, std::string_view name) {
  std::optional<std::string> value = env(name);
  if (value && value->empty()) return std::nullopt;
  return value;
}

}  // namespace

EnvLookup ProcessEnvironment() {
  return [](std::string_view name) -> std::optional<std::string> {
    const char* value = std::getenv(std::string(name).c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  };
}

Result<IniFile> ParseAwsIni(std::string_view text, std::string_view path) {
  IniFile ini;
  std::string section;
  std::string parent;  // the key of the sub-section being read, or empty
  size_t line_number = 0;
  while (!text.empty()) {
    const size_t end = text.find('\n');
    std::string_view raw = text.substr(0, end);
    text.remove_prefix(end == std::string_view::npos ? text.size() : end + 1);
    ++line_number;
    const bool indented = !raw.empty() && (raw.front() == ' ' || raw.front() == '\t');
    const std::string_view line = Trim(raw);
    if (line.empty() || line.front() == '#' || line.front() == ';') continue;
    auto bad = [&](std::string_view why) {
      return InvalidArgumentError(std::string(path) + " line " + std::to_string(line_number) +
                                  ": " + std::string(why) + ": '" + std::string(line) + "'");
    };
    if (line.front() == '[') {
      if (line.back() != ']' || line.size() < 3) return bad("a section header is [name]");
      section = std::string(Trim(line.substr(1, line.size() - 2)));
      parent.clear();
      ini[section];
      continue;
    }
    const size_t eq = line.find('=');
    if (eq == std::string_view::npos) return bad("expected key = value");
    if (section.empty()) return bad("a key before any [section]");
    const std::string key(Trim(line.substr(0, eq)));
    const std::string value(Trim(line.substr(eq + 1)));
    if (key.empty()) return bad("expected key = value");
    if (indented && !parent.empty()) {
      ini[section][parent + "." + key] = value;
      continue;
    }
    ini[section][key] = value;
    parent = value.empty() ? key : std::string();
  }
  return ini;
}

Result<S3Config> ResolveS3Config(const EnvLookup& env, std::string_view home) {
  S3Config config;
  std::string home_dir(home);
  if (home_dir.empty()) home_dir = NonEmpty(env, "HOME").value_or("");
  const std::string aws_dir = home_dir.empty() ? std::string(".aws") : home_dir + "/.aws";
  const std::string credentials_path =
      NonEmpty(env, "AWS_SHARED_CREDENTIALS_FILE").value_or(aws_dir + "/credentials");
  const std::string config_path = NonEmpty(env, "AWS_CONFIG_FILE").value_or(aws_dir + "/config");
  SP_ASSIGN_OR_RETURN(IniFile credentials_file, ReadIni(credentials_path));
  SP_ASSIGN_OR_RETURN(IniFile config_file, ReadIni(config_path));

  const std::optional<std::string> named_profile = NonEmpty(env, "AWS_PROFILE");
  config.profile = named_profile.value_or("default");
  const std::string credentials_section = config.profile;
  const std::string config_section =
      config.profile == "default" ? "default" : "profile " + config.profile;
  if (named_profile && !credentials_file.count(credentials_section) &&
      !config_file.count(config_section)) {
    return InvalidArgumentError("AWS_PROFILE names profile '" + config.profile +
                                "', which neither " + credentials_path + " nor " + config_path +
                                " has");
  }
  auto profile_value = [&](const std::string& key) -> std::optional<std::string> {
    if (auto v = Get(credentials_file, credentials_section, key)) return v;
    return Get(config_file, config_section, key);
  };

  // Credentials: the environment's pair, else the profile's.
  std::optional<std::string> key_id = NonEmpty(env, "AWS_ACCESS_KEY_ID");
  std::optional<std::string> secret = NonEmpty(env, "AWS_SECRET_ACCESS_KEY");
  std::optional<std::string> token = NonEmpty(env, "AWS_SESSION_TOKEN");
  std::string source = "the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)";
  if (!key_id && !secret) {
    key_id = profile_value("aws_access_key_id");
    secret = profile_value("aws_secret_access_key");
    token = profile_value("aws_session_token");
    source = "profile '" + config.profile + "'";
  }
  if (key_id.has_value() != secret.has_value()) {
    return InvalidArgumentError("incomplete AWS credentials from " + source + ": " +
                                (key_id ? "an access key id without a secret access key"
                                        : "a secret access key without an access key id"));
  }
  if (key_id) {
    config.credentials = AwsCredentials{*key_id, *secret, token.value_or("")};
  }

  if (auto region = NonEmpty(env, "AWS_REGION")) {
    config.region = *region;
  } else if (auto fallback = NonEmpty(env, "AWS_DEFAULT_REGION")) {
    config.region = *fallback;
  } else if (auto configured = Get(config_file, config_section, "region")) {
    config.region = *configured;
  }

  std::optional<std::string> endpoint = NonEmpty(env, "AWS_ENDPOINT_URL_S3");
  if (!endpoint) endpoint = NonEmpty(env, "AWS_ENDPOINT_URL");
  if (!endpoint) endpoint = Get(config_file, config_section, "s3.endpoint_url");
  if (!endpoint) endpoint = Get(config_file, config_section, "endpoint_url");
  const bool custom_endpoint = endpoint.has_value();
  config.endpoint = endpoint.value_or("https://s3." + config.region + ".amazonaws.com");
  while (!config.endpoint.empty() && config.endpoint.back() == '/') config.endpoint.pop_back();
  const bool http = config.endpoint.rfind("http://", 0) == 0;
  const bool https = config.endpoint.rfind("https://", 0) == 0;
  const size_t host_at = http ? 7 : 8;
  if ((!http && !https) || config.endpoint.size() <= host_at ||
      config.endpoint.find('/', host_at) != std::string::npos) {
    return InvalidArgumentError("S3 endpoint '" + config.endpoint +
                                "' is not an http:// or https:// URL of a host (and port)");
  }

  std::optional<std::string> attempts = NonEmpty(env, "AWS_MAX_ATTEMPTS");
  std::string attempts_from = "AWS_MAX_ATTEMPTS";
  if (!attempts) {
    attempts = Get(config_file, config_section, "max_attempts");
    attempts_from = config_path + " profile '" + config.profile + "': max_attempts";
  }
  if (attempts) {
    char* end = nullptr;
    const long n = std::strtol(attempts->c_str(), &end, 10);
    if (attempts->empty() || *end != '\0' || n < 1 || n > 1000) {
      return InvalidArgumentError(attempts_from + " is '" + *attempts +
                                  "', expected a number of attempts from 1 to 1000");
    }
    config.max_attempts = static_cast<int>(n);
  }
  if (auto bundle = NonEmpty(env, "AWS_CA_BUNDLE")) {
    config.ca_bundle = *bundle;
  } else if (auto configured = Get(config_file, config_section, "ca_bundle")) {
    config.ca_bundle = *configured;
  }

  const std::string style =
      Get(config_file, config_section, "s3.addressing_style").value_or("auto");
  if (style == "path") {
    config.path_style = true;
  } else if (style == "virtual") {
    config.path_style = false;
  } else if (style == "auto") {
    config.path_style = custom_endpoint;
  } else {
    return InvalidArgumentError(config_path + " profile '" + config.profile +
                                "': s3 addressing_style is '" + style +
                                "', expected path, virtual or auto");
  }
  return config;
}

}  // namespace sp
