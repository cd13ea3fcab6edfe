#include "shardpoint/store/s3/aws_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <map>

namespace sp {
namespace {

using ::testing::HasSubstr;

class AwsConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    home_ = (std::filesystem::temp_directory_path() / "sp_aws_XXXXXX").string();
    ASSERT_NE(mkdtemp(home_.data()), nullptr);
    std::filesystem::create_directories(home_ + "/.aws");
  }
  void TearDown() override { std::filesystem::remove_all(home_); }

  void Write(const std::string& name, const std::string& text) {
    std::ofstream(home_ + "/.aws/" + name) << text;
  }
  EnvLookup Env() const {
    return [this](std::string_view name) -> std::optional<std::string> {
      auto it = env_.find(std::string(name));
      if (it == env_.end()) return std::nullopt;
      return it->second;
    };
  }
  Result<S3Config> Resolve() const { return ResolveS3Config(Env(), home_); }

  std::string home_;
  std::map<std::string, std::string> env_;
};

TEST_F(AwsConfigTest, NothingConfiguredIsAwsUnsignedInUsEast1) {
  Result<S3Config> config = Resolve();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->profile, "default");
  EXPECT_EQ(config->region, "us-east-1");
  EXPECT_EQ(config->endpoint, "https://s3.us-east-1.amazonaws.com");
  EXPECT_FALSE(config->path_style);
  EXPECT_TRUE(config->credentials.empty());
}

TEST_F(AwsConfigTest, AttemptsAndCaBundleFromTheEnvironmentOrTheProfile) {
  Write("config", "[default]\nmax_attempts = 7\nca_bundle = /etc/corp-ca.pem\n");
  Result<S3Config> config = Resolve();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->max_attempts, 7);
  EXPECT_EQ(config->ca_bundle, "/etc/corp-ca.pem");
  env_ = {{"AWS_MAX_ATTEMPTS", "3"}, {"AWS_CA_BUNDLE", "/tmp/ca.pem"}};
  config = Resolve();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->max_attempts, 3);
  EXPECT_EQ(config->ca_bundle, "/tmp/ca.pem");
  for (const char* bad : {"0", "many", "5x", "1001"}) {
    env_ = {{"AWS_MAX_ATTEMPTS", bad}};
    Result<S3Config> refused = Resolve();
    EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(refused.status().message(),
                HasSubstr("AWS_MAX_ATTEMPTS is '" + std::string(bad) +
                          "', expected a number of attempts from 1 to 1000"));
  }
  env_.clear();
  Write("config", "[default]\nmax_attempts = -2\n");
  Result<S3Config> refused = Resolve();
  EXPECT_THAT(refused.status().message(), HasSubstr("profile 'default': max_attempts is '-2'"));
}

TEST_F(AwsConfigTest, TheEnvironmentWinsOverTheFiles) {
  Write("credentials",
        "[default]\naws_access_key_id = FILEKEY\naws_secret_access_key = filesecret\n");
  Write("config", "[default]\nregion = eu-west-1\nendpoint_url = http://files:9000\n");
  env_ = {{"AWS_ACCESS_KEY_ID", "ENVKEY"}, {"AWS_SECRET_ACCESS_KEY", "envsecret"},
          {"AWS_SESSION_TOKEN", "token"}, {"AWS_REGION", "ap-south-1"},
          {"AWS_DEFAULT_REGION", "us-west-2"}, {"AWS_ENDPOINT_URL", "http://generic:1"},
          {"AWS_ENDPOINT_URL_S3", "http://127.0.0.1:8333/"}};
  Result<S3Config> config = Resolve();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->credentials.access_key_id, "ENVKEY");
  EXPECT_EQ(config->credentials.secret_access_key, "envsecret");
  EXPECT_EQ(config->credentials.session_token, "token");
  EXPECT_EQ(config->region, "ap-south-1");
  EXPECT_EQ(config->endpoint, "http://127.0.0.1:8333");
  EXPECT_TRUE(config->path_style) << "a custom endpoint is path-style by default";
  env_.erase("AWS_ENDPOINT_URL_S3");
  env_.erase("AWS_REGION");
  config = Resolve();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->endpoint, "http://generic:1");
  EXPECT_EQ(config->region, "us-west-2");
}

TEST_F(AwsConfigTest, ProfilesComeFromBothFiles) {
  Write("credentials",
        "# comment\n[default]\naws_access_key_id = D\naws_secret_access_key = d\n\n"
        "[train]\naws_access_key_id = T\naws_secret_access_key = t\naws_session_token = tt\n");
  Write("config",
        "[default]\nregion = eu-central-1\n"
        "[profile train]\nregion = us-east-2\ns3 =\n  endpoint_url = http://minio:9000\n"
        "  addressing_style = virtual\n; comment\nendpoint_url = http://other:1\n");
  env_ = {{"AWS_PROFILE", "train"}};
  Result<S3Config> config = Resolve();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->profile, "train");
  EXPECT_EQ(config->credentials.access_key_id, "T");
  EXPECT_EQ(config->credentials.session_token, "tt");
  EXPECT_EQ(config->region, "us-east-2");
  EXPECT_EQ(config->endpoint, "http://minio:9000") << "s3's own endpoint_url first";
  EXPECT_FALSE(config->path_style);
  env_.clear();
  config = Resolve();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->credentials.access_key_id, "D");
  EXPECT_EQ(config->region, "eu-central-1");
  EXPECT_EQ(config->endpoint, "https://s3.eu-central-1.amazonaws.com");
}

TEST_F(AwsConfigTest, FilesNamedByTheEnvironmentAreRead) {
  std::ofstream(home_ + "/creds")
      << "[default]\naws_access_key_id = K\naws_secret_access_key = s\n";
  std::ofstream(home_ + "/cfg") << "[default]\ns3 =\n  addressing_style = path\n";
  env_ = {{"AWS_SHARED_CREDENTIALS_FILE", home_ + "/creds"}, {"AWS_CONFIG_FILE", home_ + "/cfg"}};
  Result<S3Config> config = Resolve();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->credentials.access_key_id, "K");
  EXPECT_TRUE(config->path_style);
}

TEST_F(AwsConfigTest, ErrorsNameWhatIsWrong) {
  env_ = {{"AWS_PROFILE", "nope"}};
  Result<S3Config> config = Resolve();
  EXPECT_EQ(config.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(config.status().message(), HasSubstr("profile 'nope'"));

  env_ = {{"AWS_ACCESS_KEY_ID", "K"}};
  config = Resolve();
  EXPECT_THAT(config.status().message(),
              HasSubstr("an access key id without a secret access key"));

  env_ = {{"AWS_ENDPOINT_URL", "ftp://host"}};
  config = Resolve();
  EXPECT_THAT(config.status().message(), HasSubstr("'ftp://host' is not an http:// or https://"));
  env_ = {{"AWS_ENDPOINT_URL", "http://host/path"}};
  EXPECT_FALSE(Resolve().ok());

  env_.clear();
  Write("config", "[default]\ns3 =\n  addressing_style = sideways\n");
  config = Resolve();
  EXPECT_THAT(config.status().message(), HasSubstr("addressing_style is 'sideways'"));

  Write("config", "[default]\nregion\n");
  config = Resolve();
  EXPECT_EQ(config.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(config.status().message(), HasSubstr("/.aws/config line 2: expected key = value"));
  Write("config", "region = x\n");
  EXPECT_THAT(Resolve().status().message(), HasSubstr("line 1: a key before any [section]"));
}

}  // namespace
}  // namespace sp
