// Writing new K/V tokens into jaxserve's stacked paged cache on the CPU: one XLA FFI custom call per
// layer for both caches, each output aliased to its input so the cache is updated in place. Built on
// first use by cpu_kv_write.py (g++ -O3 -march=native).
//
// Why it exists: XLA:CPU has no float8 scatter. Its float normalization widened an 8-bit cache
// (`--kv-cache-dtype fp8*`) to float16 around every layer's write; scattering the cache's bytes
// instead needs a bitcast of the whole cache to uint8 and back, which XLA:CPU runs as two full
// copies per layer. Here a token's row is copied as bytes, whatever the element type, so the
// cache is never touched beyond the rows written.
//
// Semantics are `write_kv`'s (pallas_kernels/kv_write.py): token t goes to flat slot
// slot_mapping[t] = page * page_size + offset of `layer`, one [kv_heads, head_dim] row per kv
// head; a slot outside [0, num_pages * page_size) (-1 is padding) is dropped, and so is every
// token when `layer` is outside [0, num_layers), as the scatter's mode="drop" would.

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error Write(ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::AnyBuffer k_new, ffi::AnyBuffer v_new,
                 ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::AnyBuffer> k_out,
                 ffi::Result<ffi::AnyBuffer> v_out) {
  const auto pd = k_pages.dimensions(), nd = k_new.dimensions();
  if (pd.size() != 5 || nd.size() != 3)
    return ffi::Error::InvalidArgument("cpu kv write: the cache must be 5-D and the new tokens 3-D");
  const ffi::DataType t = k_pages.element_type();
  if (v_pages.element_type() != t || k_new.element_type() != t || v_new.element_type() != t ||
      k_out->element_type() != t || v_out->element_type() != t)
    return ffi::Error::InvalidArgument("cpu kv write: the caches and the new tokens must share a dtype");
  const int64_t layers = pd[0], heads = pd[1], pages = pd[2], page_size = pd[3], dim = pd[4];
  const int64_t tokens = nd[0];
  if (nd[1] != heads || nd[2] != dim || static_cast<int64_t>(slots.element_count()) != tokens ||
      layer.element_count() != 1 || v_pages.element_count() != k_pages.element_count() ||
      v_new.element_count() != k_new.element_count())
    return ffi::Error::InvalidArgument(
        "cpu kv write: new tokens must be [tokens, kv_heads, head_dim] of the cache, slot_mapping [tokens]");
  const int64_t row = dim * static_cast<int64_t>(ffi::ByteWidth(t));  // bytes of one head's row
  const int64_t page_bytes = page_size * row;
  const int64_t head_bytes = pages * page_bytes;
  // XLA honours the aliasing, so out is the cache itself; were it ever not, copy the cache first
  // so the result is still the whole cache with the tokens written.
  struct Cache {
    const void* in;
    void* out;
    const void* fresh;
  };
  const Cache caches[2] = {{k_pages.untyped_data(), k_out->untyped_data(), k_new.untyped_data()},
                           {v_pages.untyped_data(), v_out->untyped_data(), v_new.untyped_data()}};
  const int64_t total = layers * heads * head_bytes;
  for (const Cache& c : caches)
    if (c.out != c.in) std::memcpy(c.out, c.in, static_cast<size_t>(total));
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= layers) return ffi::Error::Success();
  const int32_t* slot = slots.typed_data();
  for (int64_t i = 0; i < tokens; ++i) {
    const int64_t s = slot[i];
    if (s < 0 || s >= pages * page_size) continue;  // padding, or a slot past the cache: dropped
    const int64_t at = (s / page_size) * page_bytes + (s % page_size) * row;
    for (const Cache& c : caches) {
      char* dst = static_cast<char*>(c.out) + l * heads * head_bytes + at;
      const char* src = static_cast<const char*>(c.fresh) + i * heads * row;
      for (int64_t h = 0; h < heads; ++h) std::memcpy(dst + h * head_bytes, src + h * row, static_cast<size_t>(row));
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveKvWrite, Write,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // k pages (stacked), aliased to the first result
                                  .Arg<ffi::AnyBuffer>()  // v pages (stacked), aliased to the second
                                  .Arg<ffi::AnyBuffer>()  // k_new [tokens, kv_heads, head_dim]
                                  .Arg<ffi::AnyBuffer>()  // v_new
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_mapping [tokens]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
