#include "fusion_buffer.h"

#include <cstring>

namespace fusionring {

std::size_t pack(const std::vector<BufferView>& views, void* dst) {
  char* out = static_cast<char*>(dst);
  std::size_t offset = 0;
  for (const auto& v : views) {
    if (v.bytes) std::memcpy(out + offset, reinterpret_cast<const void*>(v.address), v.bytes);
    offset += v.bytes;
  }
  return offset;
}

std::size_t unpack(const void* src, const std::vector<BufferView>& views) {
  const char* in = static_cast<const char*>(src);
  std::size_t offset = 0;
  for (const auto& v : views) {
    if (v.bytes) std::memcpy(reinterpret_cast<void*>(v.address), in + offset, v.bytes);
    offset += v.bytes;
  }
  return offset;
}

}  // namespace fusionring
