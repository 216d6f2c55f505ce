// A read-bandwidth probe: how fast this machine streams memory into registers, with one thread
// and with all of torch's. Every kernel's achieved rate is reported as a fraction of it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace quill {
namespace {

// Eight independent accumulators so the adds never wait on each other: the loads set the pace.
float read_range(const float* p, int64_t begin, int64_t end) {
  constexpr int kStep = 8 * kWidth;
  vfloat a[8];
  for (auto& x : a) x = vzero();
  int64_t i = begin;
  for (; i + kStep <= end; i += kStep) {
    for (int j = 0; j < 8; ++j) a[j] = vadd(a[j], vload(p + i + j * kWidth));
  }
  float tail = 0.0f;
  for (; i < end; ++i) tail += p[i];
  for (int j = 1; j < 8; ++j) a[0] = vadd(a[0], a[j]);
  return vsum(a[0]) + tail;
}

}  // namespace

at::Tensor read_probe(const at::Tensor& buffer, int64_t num_threads, int64_t repeats) {
  TORCH_CHECK(buffer.scalar_type() == at::kFloat && buffer.is_contiguous(), "quill::read_probe: buffer must be contiguous fp32");
  TORCH_CHECK(num_threads >= 1 && repeats >= 1, "quill::read_probe: num_threads and repeats must be positive");
  const float* p = buffer.data_ptr<float>();
  const int64_t n = buffer.numel();
  const int threads = num_threads == 1 ? 1 : at::get_num_threads();
  double best = std::numeric_limits<double>::infinity();
  double checksum = 0.0;
  std::vector<float> partial(threads, 0.0f);
  for (int64_t r = 0; r < repeats; ++r) {
    auto start = std::chrono::steady_clock::now();
    if (threads == 1) {
      partial[0] = read_range(p, 0, n);
    } else {
      const int64_t per = (n + threads - 1) / threads;
      at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) partial[t] = read_range(p, t * per, std::min(n, (t + 1) * per));
      });
    }
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::min(best, seconds);
    for (float s : partial) checksum += s;
  }
  at::Tensor out = at::empty({2}, buffer.options().dtype(at::kDouble));
  out.data_ptr<double>()[0] = best;
  out.data_ptr<double>()[1] = checksum;
  return out;
}

}  // namespace quill
