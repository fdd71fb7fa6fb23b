// A user of the installed package: links m3rt::m3rt and runs one op on the CPU.
#include <m3rt/m3rt.h>

#include <cstdio>

int main() {
  using namespace m3rt;
  Tensor x = Tensor::empty({2, 8}, DType::kBFloat16), w = Tensor::empty({8}, DType::kBFloat16);
  for (int i = 0; i < 16; ++i) x.ptr<uint16_t>()[i] = float_to_bf16(float(i) - 7.5f);
  for (int i = 0; i < 8; ++i) w.ptr<uint16_t>()[i] = float_to_bf16(0.f);
  Tensor out = Tensor::empty({2, 8}, DType::kBFloat16);
  gemma_rms_norm(out, x, w, 1e-6f);
  const float y = bf16_to_float(out.ptr<uint16_t>()[0]);  // -7.5 / rms(-7.5..-0.5)
  std::printf("consumer: out[0] = %g\n", y);
  return (y < -1.5f && y > -1.8f) ? 0 : 1;
}
