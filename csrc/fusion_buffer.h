// Pack many tensors into one contiguous fusion buffer, and unpack them again, in one call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace fusionring {

struct BufferView {
  std::uintptr_t address;
  std::size_t bytes;
};

// Copies each view, in order, into `dst`; returns the bytes written.
std::size_t pack(const std::vector<BufferView>& views, void* dst);

// Copies consecutive pieces of `src` back into each view, in order; returns the bytes read.
std::size_t unpack(const void* src, const std::vector<BufferView>& views);

}  // namespace fusionring
