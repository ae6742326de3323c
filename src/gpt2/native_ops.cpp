// gpt2_native: ops of our own in C++ (native_ops.py builds and loads this file).
//
// linear_dynamic(x, key, out_features, reduce_range): an engine's dynamic linear on the packed weight that
// name_packed(key, packed) named, as quantized::linear_dynamic (fbgemm's and oneDNN's u8s8 GEMMs) and
// quantized::linear_dynamic_fp16 (fbgemm's fp16 GEMM) compute it: both call the packed weight's
// apply_dynamic. A compiled graph cannot hold the packed weight (a TorchScript object), so it holds its
// key; looking it up here keeps the call in C++ (a Python op costs ~20 us a call from a compiled step, and
// passing the object from Python ~9 us: its conversion). The registry holds each weight from name_packed
// to forget_packed, which Python calls when the weight's holder (quantize._Packed) is renamed or
// collected: not weakly, as a weak reference would keep a dead weight's memory until it was dropped.
#include <ATen/native/quantized/PackedParams.h>
#include <torch/library.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using Packed = c10::intrusive_ptr<LinearPackedParamsBase>;

std::mutex registry_lock;
std::unordered_map<std::string, std::vector<Packed>> registry;  // key -> the weights of that name

void name_packed(c10::string_view key, Packed packed) {
  std::lock_guard<std::mutex> guard(registry_lock);
  auto& named = registry[std::string(key)];  // two models of the same weights share their keys
  if (std::find(named.begin(), named.end(), packed) == named.end()) named.push_back(std::move(packed));
}

void forget_packed(c10::string_view key, Packed packed) {
  std::lock_guard<std::mutex> guard(registry_lock);
  auto found = registry.find(std::string(key));
  if (found == registry.end()) return;
  auto& named = found->second;
  named.erase(std::remove(named.begin(), named.end(), packed), named.end());
  if (named.empty()) registry.erase(found);
}

at::Tensor linear_dynamic(const at::Tensor& x, c10::string_view key, int64_t out_features, bool reduce_range) {
  Packed packed;
  {
    std::lock_guard<std::mutex> guard(registry_lock);
    auto found = registry.find(std::string(key));
    if (found != registry.end()) packed = found->second.front();  // any: they hold the same weights
  }
  TORCH_CHECK(packed, "no packed weight named ", key, " is alive in this process");
  at::Tensor y = packed->apply_dynamic(x, reduce_range);  // (M, N) float32
  TORCH_CHECK(y.size(-1) == out_features, "the weight named ", key, " has ", y.size(-1), " outputs, not ",
              out_features);
  return y;
}

}  // namespace

TORCH_LIBRARY(gpt2_native, m) {
  m.def("name_packed(str key, __torch__.torch.classes.quantized.LinearPackedParamsBase packed) -> ()", name_packed);
  m.def("forget_packed(str key, __torch__.torch.classes.quantized.LinearPackedParamsBase packed) -> ()", forget_packed);
  m.def("linear_dynamic(Tensor x, str key, int out_features, bool reduce_range) -> Tensor");
  m.impl("linear_dynamic", c10::DispatchKey::CPU, TORCH_FN(linear_dynamic));
}
