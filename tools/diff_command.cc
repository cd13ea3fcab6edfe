// shardpoint diff A B [--json] [--atol X]
#include <charconv>
#include <cmath>
#include <cstdio>
#include <iostream>

#include "shardpoint/manage.h"
#include "tools/cli.h"

namespace sp::cli {
namespace {

constexpr char kDiffUsage[] =
    "usage: shardpoint diff A B [--json] [--atol X] [--allow-external-links]\n"
    "\n"
    "Compares the checkpoints A and B: keys only in A or only in B, tensors whose dtype or shape\n"
    "differ, tensors whose values differ (count, largest absolute difference, first index), and\n"
    "objects whose payloads differ. Floating types are compared in float64 (NaN equals NaN),\n"
    "integers and bool exactly. Reads chunk by chunk in bounded memory.\n"
    "Exits 0 when equal, 1 when they differ (or on an error).\n"
    "  --atol X   floating values differing by at most X count as equal (default 0)\n"
    "  --json     print the report as one JSON document\n"
    "  --allow-external-links  read files that symbolic links lead outside the checkpoints\n";

std::string JsonList(const std::vector<std::string>& items) {
  std::string out = "[";
  for (size_t i = 0; i < items.size(); ++i) out += (i ? "," : "") + JsonQuote(items[i]);
  return out + "]";
}

std::string JsonInts(const std::vector<int64_t>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? "," : "") + std::to_string(v[i]);
  return out + "]";
}

// A JSON number; JSON has no infinity, so an infinite difference is written as a string.
std::string JsonDouble(double d) {
  if (std::isinf(d)) return "\"inf\"";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.17g", d);
  return buf;
}

void PrintJson(const DiffReport& r) {
  std::cout << "{\"equal\":" << (r.equal() ? "true" : "false")
            << ",\"tensors_only_in_a\":" << JsonList(r.tensors_only_in_a)
            << ",\"tensors_only_in_b\":" << JsonList(r.tensors_only_in_b)
            << ",\"objects_only_in_a\":" << JsonList(r.objects_only_in_a)
            << ",\"objects_only_in_b\":" << JsonList(r.objects_only_in_b) << ",\"mismatched\":[";
  for (size_t i = 0; i < r.mismatched.size(); ++i) {
    const TensorMismatch& m = r.mismatched[i];
    std::cout << (i ? "," : "") << "{\"name\":" << JsonQuote(m.name) << ",\"dtype_a\":\""
              << DTypeName(m.dtype_a) << "\",\"dtype_b\":\"" << DTypeName(m.dtype_b)
              << "\",\"shape_a\":" << JsonInts(m.shape_a) << ",\"shape_b\":" << JsonInts(m.shape_b)
              << "}";
  }
  std::cout << "],\"values_differ\":[";
  for (size_t i = 0; i < r.values_differ.size(); ++i) {
    const TensorValueDiff& v = r.values_differ[i];
    std::cout << (i ? "," : "") << "{\"name\":" << JsonQuote(v.name) << ",\"dtype\":\""
              << DTypeName(v.dtype) << "\",\"elements_differing\":" << v.elements_differing
              << ",\"max_abs_diff\":" << JsonDouble(v.max_abs_diff)
              << ",\"first_index\":" << JsonInts(v.first_index) << "}";
  }
  std::cout << "],\"objects_differ\":" << JsonList(r.objects_differ)
            << ",\"tensors_compared\":" << r.tensors_compared
            << ",\"elements_compared\":" << r.elements_compared << "}\n";
}

void PrintText(const std::string& a, const std::string& b, const DiffReport& r) {
  for (const std::string& t : r.tensors_only_in_a) std::cout << "only in A: tensor " << t << "\n";
  for (const std::string& t : r.tensors_only_in_b) std::cout << "only in B: tensor " << t << "\n";
  for (const std::string& o : r.objects_only_in_a) std::cout << "only in A: object " << o << "\n";
  for (const std::string& o : r.objects_only_in_b) std::cout << "only in B: object " << o << "\n";
  for (const TensorMismatch& m : r.mismatched) {
    std::cout << "differs: tensor " << m.name << ": " << DTypeName(m.dtype_a)
              << ShapeToString(m.shape_a) << " in A, " << DTypeName(m.dtype_b)
              << ShapeToString(m.shape_b) << " in B\n";
  }
  for (const TensorValueDiff& v : r.values_differ) {
    std::cout << "differs: tensor " << v.name << ": " << v.elements_differing
              << " element(s), max abs diff " << JsonDouble(v.max_abs_diff) << ", first at "
              << JsonInts(v.first_index) << "\n";
  }
  for (const std::string& o : r.objects_differ) std::cout << "differs: object " << o << "\n";
  std::cout << (r.equal() ? "EQUAL: " : "DIFFERENT: ") << a << " and " << b << ": "
            << r.tensors_compared << " tensor(s) compared, " << r.elements_compared
            << " element(s)\n";
}

Result<double> ParseAtol(const std::string& text) {
  double value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || !(value >= 0) || std::isinf(value)) {
    return InvalidArgumentError("--atol expects a finite number >= 0, not '" + text + "'");
  }
  return value;
}

}  // namespace

int DiffCommand(const std::vector<std::string>& argv) {
  Result<Args> args = ParseArgs(argv, {"json", "help", kLinksFlag}, {"atol"});
  if (!args.ok()) return UsageError("diff", args.status().message(), kDiffUsage);
  if (args->Has("help")) {
    std::cout << kDiffUsage;
    return kExitOk;
  }
  if (args->positional.size() != 2) {
    return UsageError("diff", "expected two checkpoints A and B", kDiffUsage);
  }
  DiffOptions options;
  if (args->Has("atol")) {
    Result<double> atol = ParseAtol(args->Get("atol", ""));
    if (!atol.ok()) return UsageError("diff", atol.status().message(), kDiffUsage);
    options.atol = *atol;
  }
  const std::string& a = args->positional[0];
  const std::string& b = args->positional[1];
  Result<std::unique_ptr<Store>> store_a = StoreFor(*args, a);
  if (!store_a.ok()) return Fail("diff", store_a.status());
  Result<std::unique_ptr<Store>> store_b = StoreFor(*args, b);
  if (!store_b.ok()) return Fail("diff", store_b.status());
  options.store_a = store_a->get();
  options.store_b = store_b->get();
  Result<DiffReport> report = Diff(a, b, options);
  if (!report.ok()) return Fail("diff", report.status());
  if (args->Has("json")) {
    PrintJson(*report);
  } else {
    PrintText(a, b, *report);
  }
  return report->equal() ? kExitOk : kExitFailure;
}

}  // namespace sp::cli
