// A read-bandwidth probe: how fast this machine streams memory into registers, with one thread
// and with all of torch's, in one sequential pass or in scattered chunks the size of a paged
// cache's blocks. Every kernel's achieved rate is reported as a fraction of it.
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

// Chunks of `chunk` floats in a scattered order (chunk c at (c * stride) mod count, stride
// coprime to count), each prefetched two chunks ahead: how a paged cache's blocks are read.
float read_chunks(const float* p, int64_t chunk, int64_t count, int64_t stride, int64_t begin, int64_t end) {
  float total = 0.0f;
  auto at = [&](int64_t c) { return p + ((c * stride) % count) * chunk; };
  for (int64_t c = begin; c < end; ++c) {
    if (c + 2 < end) {
      const char* next = reinterpret_cast<const char*>(at(c + 2));
      for (int64_t off = 0; off < chunk * int64_t(sizeof(float)); off += 64) _mm_prefetch(next + off, _MM_HINT_T1);
    }
    total += read_range(at(c), 0, chunk);
  }
  return total;
}

int64_t gcd(int64_t a, int64_t b) { return b == 0 ? a : gcd(b, a % b); }

}  // namespace

at::Tensor read_probe(const at::Tensor& buffer, int64_t num_threads, int64_t repeats, int64_t chunk_bytes) {
  TORCH_CHECK(buffer.scalar_type() == at::kFloat && buffer.is_contiguous(), "quill::read_probe: buffer must be contiguous fp32");
  TORCH_CHECK(num_threads >= 1 && repeats >= 1, "quill::read_probe: num_threads and repeats must be positive");
  TORCH_CHECK(chunk_bytes >= 0 && chunk_bytes % 256 == 0, "quill::read_probe: chunk_bytes must be a multiple of 256");
  const float* p = buffer.data_ptr<float>();
  const int64_t chunk = chunk_bytes / int64_t(sizeof(float));
  const int64_t n = chunk ? buffer.numel() / chunk * chunk : buffer.numel();
  const int64_t count = chunk ? n / chunk : 0;
  int64_t stride = 7919;  // a prime; stepped until coprime to the chunk count
  while (count && gcd(stride, count) != 1) stride += 2;
  const int threads = num_threads == 1 ? 1 : at::get_num_threads();
  double best = std::numeric_limits<double>::infinity();
  double checksum = 0.0;
  std::vector<float> partial(threads, 0.0f);
  for (int64_t r = 0; r < repeats; ++r) {
    auto start = std::chrono::steady_clock::now();
    auto part = [&](int t) {
      if (!chunk) {
        const int64_t per = (n + threads - 1) / threads;
        return read_range(p, t * per, std::min(n, (t + 1) * per));
      }
      const int64_t per = (count + threads - 1) / threads;
      return read_chunks(p, chunk, count, stride, t * per, std::min(count, (t + 1) * per));
    };
    if (threads == 1) {
      partial[0] = part(0);
    } else {
      at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) partial[t] = part(int(t));
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
