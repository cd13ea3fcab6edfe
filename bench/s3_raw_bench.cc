// The raw throughput of an S3 server through shardpoint's own client (store/s3/s3_client.h): a
// plain parallel PUT of BYTES bytes as objects of PART bytes on THREADS threads, then a parallel
// GET of them, each timed alone. The baseline of bench/s3_bench.py, which runs it on the same
// server and the same bytes as the checkpoints; configured as the AWS tools are
// (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...). Prints one line of JSON.
//
//   s3_raw_bench --bucket B --prefix P --bytes N [--part 16777216] [--threads 8] [--runs 3]
#include <algorithm>
#include <atomic>
#include <functional>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "shardpoint/store/s3/aws_config.h"
#include "shardpoint/store/s3/s3_client.h"

namespace {

// Runs `work(i, t)` for i in [0, n) on `threads` threads (t: the thread's index); the first
// failure, or OK.
sp::Status Parallel(int threads, uint64_t n,
                   const std::function<sp::Status(uint64_t, int)>& work) {
  std::atomic<uint64_t> next{0};
  std::vector<sp::Status> failures(threads);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (uint64_t i = next++; i < n && failures[t].ok(); i = next++) failures[t] = work(i, t);
    });
  }
  for (std::thread& thread : pool) thread.join();
  for (const sp::Status& s : failures) {
    if (!s.ok()) return s;
  }
  return sp::OkStatus();
}

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

}  // namespace

int main(int argc, char** argv) {
  std::string bucket, prefix = "raw";
  uint64_t bytes = 0, part = uint64_t{16} << 20;
  int threads = 8, runs = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const char* value = argv[i + 1];
    if (flag == "--bucket") bucket = value;
    else if (flag == "--prefix") prefix = value;
    else if (flag == "--bytes") bytes = std::strtoull(value, nullptr, 10);
    else if (flag == "--part") part = std::strtoull(value, nullptr, 10);
    else if (flag == "--threads") threads = std::atoi(value);
    else if (flag == "--runs") runs = std::atoi(value);
    else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  if (bucket.empty() || bytes == 0 || part == 0 || threads < 1 || runs < 1) {
    std::fprintf(stderr, "usage: s3_raw_bench --bucket B --bytes N [--prefix P] [--part BYTES] "
                         "[--threads T] [--runs R]\n");
    return 2;
  }
  sp::Result<sp::S3Config> config = sp::ResolveS3Config(sp::ProcessEnvironment());
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", std::string(config.status().message()).c_str());
    return 1;
  }
  sp::S3Client client(*config);
  const uint64_t objects = (bytes + part - 1) / part;
  std::string data(part, '\0');
  std::mt19937_64 rng(1);
  for (size_t i = 0; i + 8 <= data.size(); i += 8) {
    const uint64_t v = rng();
    std::memcpy(&data[i], &v, 8);
  }
  auto key = [&](uint64_t i) { return prefix + "/object-" + std::to_string(i); };
  auto size_of = [&](uint64_t i) { return std::min(part, bytes - i * part); };
  std::vector<double> put_seconds, get_seconds;
  for (int run = 0; run < runs; ++run) {
    auto start = std::chrono::steady_clock::now();
    sp::Status put = Parallel(threads, objects, [&](uint64_t i, int) {
      return client.PutObject(bucket, key(i), sp::ByteView(reinterpret_cast<const std::byte*>(
                                                               data.data()),
                                                           size_of(i)));
    });
    put_seconds.push_back(Seconds(start));
    if (!put.ok()) {
      std::fprintf(stderr, "%s\n", std::string(put.message()).c_str());
      return 1;
    }
    start = std::chrono::steady_clock::now();
    std::vector<std::vector<std::byte>> buffers(threads, std::vector<std::byte>(part));
    sp::Status get = Parallel(threads, objects, [&](uint64_t i, int t) {
      return client.GetRange(bucket, key(i), 0, sp::MutableByteView(buffers[t].data(), size_of(i)));
    });
    get_seconds.push_back(Seconds(start));
    if (!get.ok()) {
      std::fprintf(stderr, "%s\n", std::string(get.message()).c_str());
      return 1;
    }
    Parallel(threads, objects, [&](uint64_t i, int) { return client.DeleteObject(bucket, key(i)); })
        .IgnoreError();
  }
  std::sort(put_seconds.begin(), put_seconds.end());
  std::sort(get_seconds.begin(), get_seconds.end());
  const double put = put_seconds[put_seconds.size() / 2], get = get_seconds[get_seconds.size() / 2];
  std::printf("{\"bytes\": %llu, \"objects\": %llu, \"threads\": %d, \"runs\": %d, "
              "\"put_seconds\": %.4f, \"get_seconds\": %.4f, \"put_gbps\": %.4f, "
              "\"get_gbps\": %.4f}\n",
              static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(objects),
              threads, runs, put, get, bytes / put / 1e9, bytes / get / 1e9);
  return 0;
}
