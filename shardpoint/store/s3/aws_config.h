// Where an S3 store sends its requests and with which credentials, resolved the way the AWS CLI
// and SDKs resolve them, so that a job configured for them needs nothing more.
//
// Sources, the first that gives a value winning:
//   profile      AWS_PROFILE, else "default";
//   credentials  AWS_ACCESS_KEY_ID + AWS_SECRET_ACCESS_KEY (+ AWS_SESSION_TOKEN), else the
//                profile's aws_access_key_id / aws_secret_access_key / aws_session_token in the
//                shared credentials file (AWS_SHARED_CREDENTIALS_FILE, else ~/.aws/credentials),
//                else in the config file (AWS_CONFIG_FILE, else ~/.aws/config); none: requests
//                go unsigned (a public bucket, or a local server without authentication);
//   region       AWS_REGION, AWS_DEFAULT_REGION, the profile's `region`, else "us-east-1";
//   endpoint     AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, the profile's `endpoint_url` in its
//                `s3 =` sub-section, its own `endpoint_url`, else
//                https://s3.<region>.amazonaws.com;
//   attempts     AWS_MAX_ATTEMPTS, the profile's `max_attempts` (1 to 1000; each request's tries,
//                the first included), else the client's default;
//   CA bundle    AWS_CA_BUNDLE, the profile's `ca_bundle` (a PEM file of the certificates that an
//                https:// endpoint's may chain to), else the system's;
//   addressing   the profile's `addressing_style` in its `s3 =` sub-section (path, virtual or
//                auto); auto (the default) is virtual-hosted for AWS's own endpoints and path-style
//                for any other endpoint (MinIO, SeaweedFS, Ceph RGW and the like serve it).
// In the config file a profile other than the default is the section [profile NAME]; in the
// credentials file it is [NAME]. Lines starting with '#' or ';' are comments.
//
// Pure apart from reading the two files; thread-safe.
#ifndef SHARDPOINT_STORE_S3_AWS_CONFIG_H_
#define SHARDPOINT_STORE_S3_AWS_CONFIG_H_

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "shardpoint/base/result.h"

namespace sp {

struct AwsCredentials {
  std::string access_key_id;
  std::string secret_access_key;
  std::string session_token;  // empty unless temporary credentials

  bool empty() const { return access_key_id.empty(); }
};

struct S3Config {
  std::string profile = "default";
  std::string region = "us-east-1";
  std::string endpoint;  // scheme, host and optional port, no trailing slash
  bool path_style = false;
  AwsCredentials credentials;  // empty: unsigned requests
  int max_attempts = 0;        // 0: S3ClientOptions::max_attempts
  std::string ca_bundle;       // empty: the system's certificates
};

// Looks up an environment variable; nullopt when unset.
using EnvLookup = std::function<std::optional<std::string>(std::string_view)>;

// The process environment (getenv).
EnvLookup ProcessEnvironment();

// One INI file as the AWS tools read it: section -> key -> value, where a key with an empty value
// followed by indented `key = value` lines is a sub-section whose entries are stored as
// "key.subkey" (so `s3 =\n  addressing_style = path` gives "s3.addressing_style" -> "path").
using IniFile = std::map<std::string, std::map<std::string, std::string>>;

// Parses `text` (the contents of `path`, named in errors). kInvalidArgument naming the path and
// the line for a line that is neither a section header, a `key = value` pair, a comment nor blank.
Result<IniFile> ParseAwsIni(std::string_view text, std::string_view path);

// Resolves the configuration from `env` and the shared files (read when they exist; a missing file
// is no error). `home` is the directory holding .aws/ (HOME when empty). Errors: a file that
// cannot be read or parsed, a profile named by AWS_PROFILE that neither file has, credentials
// with a key id but no secret (or the reverse), an endpoint that is not an http:// or https://
// URL, an addressing style other than path, virtual or auto.
Result<S3Config> ResolveS3Config(const EnvLookup& env, std::string_view home = {});

}  // namespace sp

#endif  // SHARDPOINT_STORE_S3_AWS_CONFIG_H_
