// pybind11 bindings: the only file of the core that knows Python. Every entry point
// takes raw addresses and counts and releases the GIL while it works.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <climits>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "adasum.h"
#include "cluster_quant.h"
#include "compressed_ring.h"
#include "dtype.h"
#include "fusion_buffer.h"
#include "nm_allreduce.h"
#include "nm_sparse.h"
#ifdef FUSIONRING_WITH_CUDA
#include "nm_sparse_cuda.h"
#endif
#include "reduce.h"
#include "ring_allreduce.h"
#include "shm_allreduce.h"
#include "transport_mpi.h"

namespace py = pybind11;
using namespace fusionring;

namespace {

// mpi4py's MPI._handleof(comm) gives the C handle as an integer: an int for MPICH-ABI
// implementations, a pointer for Open MPI. Convert either way without mpi4py headers.
template <typename Handle>
Handle handle_cast(std::uintptr_t value, std::true_type /*integral*/) {
  return static_cast<Handle>(value);
}
template <typename Handle>
Handle handle_cast(std::uintptr_t value, std::false_type /*pointer*/) {
  return reinterpret_cast<Handle>(value);
}
MPI_Comm comm_from_handle(std::uintptr_t handle) {
  return handle_cast<MPI_Comm>(handle, std::is_integral<MPI_Comm>{});
}

void* as_pointer(std::uintptr_t address) { return reinterpret_cast<void*>(address); }

std::vector<BufferView> views_of(const std::vector<std::uintptr_t>& addresses,
                                 const std::vector<std::size_t>& bytes) {
  if (addresses.size() != bytes.size()) throw InvalidArgument("addresses and sizes differ in length");
  std::vector<BufferView> views(addresses.size());
  for (std::size_t i = 0; i < views.size(); ++i) views[i] = {addresses[i], bytes[i]};
  return views;
}

ClusterConfig cluster_config(int k, std::size_t sample, std::size_t buckets, int value_dtype) {
  ClusterConfig config;
  config.k = k;
  config.sample = sample;
  config.buckets = buckets;
  config.values = dtype_from_int(value_dtype);
  cluster_check(config);
  return config;
}

class Communicator {
 public:
  explicit Communicator(std::uintptr_t handle) : transport_(comm_from_handle(handle)) {}
  int rank() const { return transport_.rank(); }
  int size() const { return transport_.size(); }

  void allreduce(std::uintptr_t address, std::size_t count, int dtype, int op, double prescale,
                 double postscale, std::size_t segment_bytes, std::size_t small_message_bytes,
                 const std::string& algorithm) {
    const DType t = dtype_from_int(dtype);
    const ReduceOp o = op_from_int(op);
    AllreduceOptions options;
    options.prescale = prescale;
    options.postscale = postscale;
    options.segment_bytes = segment_bytes ? segment_bytes : options.segment_bytes;
    options.small_message_bytes = small_message_bytes;
    if (algorithm != "auto" && algorithm != "ring" && algorithm != "recursive_doubling") {
      throw InvalidArgument("unknown allreduce algorithm '" + algorithm + "'");
    }
    py::gil_scoped_release release;
    if (algorithm == "ring") {
      ring_allreduce(as_pointer(address), count, t, o, transport_, options);
    } else if (algorithm == "recursive_doubling") {
      recursive_doubling_allreduce(as_pointer(address), count, t, o, transport_, options);
    } else {
      fusionring::allreduce(as_pointer(address), count, t, o, transport_, options);
    }
  }

  // Adasum of `count` floating-point elements at `address` (adasum.h).
  void adasum(std::uintptr_t address, std::size_t count, int dtype, double prescale,
              double postscale) {
    const DType t = dtype_from_int(dtype);
    AdasumOptions options;
    options.prescale = prescale;
    options.postscale = postscale;
    py::gil_scoped_release release;
    adasum_allreduce(as_pointer(address), count, t, transport_, options);
  }

  // N:M compressed allreduce with per-rank masks (nm_allreduce.h); float32 buffer, sum.
  // `residual` is the address of `count` floats for error feedback, or 0 for none.
  py::dict nm_allreduce(std::uintptr_t address, std::size_t count, int n, int m, int value_dtype,
                        std::uintptr_t residual, double prescale, double postscale,
                        std::size_t segment_bytes) {
    NmAllreduceOptions options;
    options.n = n;
    options.m = m;
    options.value_dtype = dtype_from_int(value_dtype);
    options.prescale = prescale;
    options.postscale = postscale;
    options.segment_bytes = segment_bytes ? segment_bytes : options.segment_bytes;
    nm_check(n, m);
    nm_check_float(options.value_dtype, "N:M values");
    NmAllreduceStats stats;
    {
      py::gil_scoped_release release;
      stats = fusionring::nm_allreduce(static_cast<float*>(as_pointer(address)), count,
                                       static_cast<float*>(as_pointer(residual)), transport_,
                                       options);
    }
    py::dict out;
    out["bytes_sent"] = stats.bytes_sent;
    out["bytes_received"] = stats.bytes_received;
    return out;
  }

  // Cluster-quantized allreduce (cluster_quant.h) on the compressed ring; float32, sum.
  py::dict cluster_allreduce(std::uintptr_t address, std::size_t count, int k, std::size_t sample,
                             std::size_t buckets, int value_dtype, std::uint64_t seed,
                             std::uint64_t step, std::uintptr_t residual, double prescale,
                             double postscale, std::size_t segment_bytes) {
    const ClusterConfig config = cluster_config(k, sample, buckets, value_dtype);
    ClusterCodec codec(config, seed, step);
    CompressedAllreduceOptions options;
    options.prescale = prescale;
    options.postscale = postscale;
    options.segment_bytes = segment_bytes ? segment_bytes : options.segment_bytes;
    CompressedAllreduceStats stats;
    {
      py::gil_scoped_release release;
      stats = compressed_allreduce(static_cast<float*>(as_pointer(address)), count,
                                   static_cast<float*>(as_pointer(residual)), transport_, codec,
                                   options);
    }
    py::dict out;
    out["bytes_sent"] = stats.bytes_sent;
    out["bytes_received"] = stats.bytes_received;
    return out;
  }

  long spin_budget_us() { return transport_.spin_budget()->current(); }

  void set_wait_policy(long spin_us, long sleep_us) {
    if (spin_us < 0 || sleep_us < 0 || sleep_us > 1000000) {
      throw InvalidArgument("wait policy needs 0 <= spin_us and 0 <= sleep_us <= 1000000");
    }
    transport_.set_wait_policy(WaitPolicy{spin_us, sleep_us});
  }

  // In-place bitwise AND of `count` uint64 words across ranks, waited for under the
  // wait policy (the negotiation's per-cycle agreement).
  void band_allreduce(std::uintptr_t address, std::size_t count) {
    if (count > static_cast<std::size_t>(INT_MAX)) throw InvalidArgument("too many words");
    int code;
    {
      py::gil_scoped_release release;
      MPI_Request request;
      code = MPI_Iallreduce(MPI_IN_PLACE, as_pointer(address), static_cast<int>(count),
                            MPI_UINT64_T, MPI_BAND, transport_.comm(), &request);
      if (code == MPI_SUCCESS) code = wait_requests(1, &request, transport_.wait_policy(),
                                             transport_.spin_budget());
    }
    if (code != MPI_SUCCESS) {
      char text[MPI_MAX_ERROR_STRING];
      int len = 0;
      MPI_Error_string(code, text, &len);
      throw CommunicationError("negotiation allreduce failed on rank " +
                               std::to_string(transport_.rank()) + ": " + std::string(text, len));
    }
  }

 private:
  MpiTransport transport_;
};

ShmAllreduceOptions shm_options(double prescale, double postscale, double timeout_s) {
  ShmAllreduceOptions options;
  options.prescale = prescale;
  options.postscale = postscale;
  options.timeout_s = timeout_s;
  return options;
}

class SharedMemoryAllreduce {
 public:
  SharedMemoryAllreduce(std::uintptr_t handle, std::size_t slot_bytes)
      : impl_(comm_from_handle(handle), slot_bytes) {}
  int rank() const { return impl_.rank(); }
  int size() const { return impl_.size(); }
  std::size_t slot_bytes() const { return impl_.slot_bytes(); }

  void allreduce(const std::vector<std::uintptr_t>& addresses, const std::vector<std::size_t>& bytes,
                 int dtype, int op, double prescale, double postscale, double timeout_s) {
    const DType t = dtype_from_int(dtype);
    const ReduceOp o = op_from_int(op);
    auto views = views_of(addresses, bytes);
    const ShmAllreduceOptions options = shm_options(prescale, postscale, timeout_s);
    py::gil_scoped_release release;
    impl_.allreduce(views, t, o, options);
  }

  void band(std::uintptr_t address, std::size_t count, double timeout_s) {
    py::gil_scoped_release release;
    impl_.band(reinterpret_cast<std::uint64_t*>(address), count, timeout_s);
  }
  bool band_then_allreduce(std::uintptr_t words, std::size_t count,
                           const std::vector<std::uintptr_t>& addresses,
                           const std::vector<std::size_t>& bytes, int dtype, int op,
                           double prescale, double postscale, double timeout_s) {
    const DType t = dtype_from_int(dtype);
    const ReduceOp o = op_from_int(op);
    auto views = views_of(addresses, bytes);
    const ShmAllreduceOptions options = shm_options(prescale, postscale, timeout_s);
    py::gil_scoped_release release;
    return impl_.band_then_allreduce(reinterpret_cast<std::uint64_t*>(words), count, views, t, o,
                                     options);
  }
  void barrier(double timeout_s) {
    py::gil_scoped_release release;
    impl_.barrier(timeout_s);
  }
  bool close(double timeout_s) {
    py::gil_scoped_release release;
    return impl_.close(timeout_s);
  }

 private:
  ShmAllreduce impl_;
};

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fusionring core: ring allreduce and buffer kernels over raw memory";

  // One mapping from core errors to Python exceptions.
  static py::exception<CommunicationError> comm_error(m, "CommunicationError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const CommunicationError& e) {
      PyErr_SetString(comm_error.ptr(), e.what());
    }
  });

  py::enum_<DType>(m, "DType")
      .value("float32", DType::kFloat32)
      .value("float64", DType::kFloat64)
      .value("float16", DType::kFloat16)
      .value("bfloat16", DType::kBFloat16)
      .value("int32", DType::kInt32)
      .value("int64", DType::kInt64)
      .value("uint8", DType::kUInt8)
      .value("int8", DType::kInt8)
      .value("int16", DType::kInt16);
  py::enum_<ReduceOp>(m, "ReduceOp")
      .value("sum", ReduceOp::kSum)
      .value("min", ReduceOp::kMin)
      .value("max", ReduceOp::kMax)
      .value("product", ReduceOp::kProduct);

  m.def("element_size", [](int dtype) { return element_size(dtype_from_int(dtype)); });

  py::class_<Communicator>(m, "Communicator")
      .def(py::init<std::uintptr_t>(), py::arg("handle"))
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("size", &Communicator::size)
      .def("allreduce", &Communicator::allreduce, py::arg("address"), py::arg("count"),
           py::arg("dtype"), py::arg("op"), py::arg("prescale") = 1.0, py::arg("postscale") = 1.0,
           py::arg("segment_bytes") = 1 << 20, py::arg("small_message_bytes") = 64 << 10,
           py::arg("algorithm") = "auto",
           "In-place allreduce of `count` elements at `address` (GIL released).")
      .def("adasum", &Communicator::adasum, py::arg("address"), py::arg("count"),
           py::arg("dtype"), py::arg("prescale") = 1.0, py::arg("postscale") = 1.0,
           "In-place Adasum of `count` floating-point elements at `address` across a "
           "power-of-two number of ranks (GIL released).")
      .def("nm_allreduce", &Communicator::nm_allreduce, py::arg("address"), py::arg("count"),
           py::arg("n"), py::arg("m"), py::arg("value_dtype") = 0, py::arg("residual") = 0,
           py::arg("prescale") = 1.0, py::arg("postscale") = 1.0,
           py::arg("segment_bytes") = 1 << 20,
           "In-place N:M-compressed sum of `count` float32 at `address` with per-rank masks "
           "(compressed reduce-scatter + allgather); returns {bytes_sent, bytes_received}.")
      .def("cluster_allreduce", &Communicator::cluster_allreduce, py::arg("address"),
           py::arg("count"), py::arg("k"), py::arg("sample"), py::arg("buckets"),
           py::arg("value_dtype"), py::arg("seed"), py::arg("step"), py::arg("residual") = 0,
           py::arg("prescale") = 1.0, py::arg("postscale") = 1.0,
           py::arg("segment_bytes") = 1 << 20,
           "In-place cluster-quantized sum of `count` float32 at `address` (compressed "
           "reduce-scatter + allgather); returns {bytes_sent, bytes_received}.")
      .def("set_wait_policy", &Communicator::set_wait_policy, py::arg("spin_us"),
           py::arg("sleep_us"),
           "How waits for MPI requests behave: sleep_us 0 polls nonstop (MPI_Wait); else test, "
           "yielding the core between tests, for a budget learned from how long waits last "
           "(250 us up to spin_us), then sleep between tests, each nap an eighth of the time "
           "waited so far (10 us to sleep_us).")
      .def_property_readonly(
          "spin_budget_us", [](Communicator& c) { return c.spin_budget_us(); },
          "How long the next wait tests before it naps (halved by each wait that outlasts "
          "it, doubled by each that ends in its second half).")
      .def("band_allreduce", &Communicator::band_allreduce, py::arg("address"), py::arg("count"),
           "In-place bitwise AND of `count` uint64 words across ranks (GIL released).");

  py::class_<SharedMemoryAllreduce>(m, "SharedMemoryAllreduce")
      .def(py::init<std::uintptr_t, std::size_t>(), py::arg("handle"), py::arg("slot_bytes") = 4 << 20,
           "Collective over the communicator; ValueError unless all its ranks share this host.")
      .def_property_readonly("rank", &SharedMemoryAllreduce::rank)
      .def_property_readonly("size", &SharedMemoryAllreduce::size)
      .def_property_readonly("slot_bytes", &SharedMemoryAllreduce::slot_bytes)
      .def("allreduce", &SharedMemoryAllreduce::allreduce, py::arg("addresses"), py::arg("bytes"),
           py::arg("dtype"), py::arg("op"), py::arg("prescale") = 1.0, py::arg("postscale") = 1.0,
           py::arg("timeout_s") = 0.0,
           "In-place allreduce of the concatenation of the (address, bytes) buffers through a "
           "shared window: no pack or unpack copy (GIL released).")
      .def("band_allreduce", &SharedMemoryAllreduce::band, py::arg("address"), py::arg("count"),
           py::arg("timeout_s") = 0.0,
           "In-place bitwise AND of `count` uint64 words at `address` across the ranks.")
      .def("band_then_allreduce", &SharedMemoryAllreduce::band_then_allreduce, py::arg("address"),
           py::arg("count"), py::arg("addresses"), py::arg("bytes"), py::arg("dtype"),
           py::arg("op"), py::arg("prescale") = 1.0, py::arg("postscale") = 1.0,
           py::arg("timeout_s") = 0.0,
           "band_allreduce and, in the same wait, the in-place allreduce of the buffers; the "
           "buffers are reduced (True on every rank) only when every rank passed identical "
           "words, else only the AND is done (False on every rank).")
      .def("barrier", &SharedMemoryAllreduce::barrier, py::arg("timeout_s") = 0.0)
      .def("close", &SharedMemoryAllreduce::close, py::arg("timeout_s"),
           "Free the window once every rank closes it too (collective); False, keeping it "
           "for MPI_Finalize, if a peer is gone or timeout_s passes first.");

  m.def(
      "reduce_into",
      [](std::uintptr_t dst, std::uintptr_t src, std::size_t count, int dtype, int op) {
        const DType t = dtype_from_int(dtype);
        const ReduceOp o = op_from_int(op);
        py::gil_scoped_release release;
        reduce_into(as_pointer(dst), as_pointer(src), count, t, o);
      },
      py::arg("dst"), py::arg("src"), py::arg("count"), py::arg("dtype"), py::arg("op"));
  m.def(
      "scale",
      [](std::uintptr_t buf, std::size_t count, int dtype, double factor) {
        const DType t = dtype_from_int(dtype);
        py::gil_scoped_release release;
        scale_in_place(as_pointer(buf), count, t, factor);
      },
      py::arg("address"), py::arg("count"), py::arg("dtype"), py::arg("factor"));
  m.def(
      "sum_squares",
      [](std::uintptr_t buf, std::size_t count, int dtype) {
        const DType t = dtype_from_int(dtype);
        py::gil_scoped_release release;
        return sum_of_squares(as_pointer(buf), count, t);
      },
      py::arg("address"), py::arg("count"), py::arg("dtype"),
      "Sum of the squares of `count` elements at `address`, accumulated in double.");
  m.def(
      "pack",
      [](const std::vector<std::uintptr_t>& addresses, const std::vector<std::size_t>& bytes,
         std::uintptr_t dst) {
        auto views = views_of(addresses, bytes);
        py::gil_scoped_release release;
        return pack(views, as_pointer(dst));
      },
      py::arg("addresses"), py::arg("bytes"), py::arg("dst"),
      "Copy each (address, bytes) piece, in order, into the buffer at dst.");
  m.def(
      "unpack",
      [](std::uintptr_t src, const std::vector<std::uintptr_t>& addresses,
         const std::vector<std::size_t>& bytes) {
        auto views = views_of(addresses, bytes);
        py::gil_scoped_release release;
        return unpack(as_pointer(src), views);
      },
      py::arg("src"), py::arg("addresses"), py::arg("bytes"),
      "Copy consecutive pieces of the buffer at src back into each (address, bytes).");

  // ---- N:M structured sparsification (nm_sparse.h). Masks are uint64 words, one bit per
  // element; values are float32/float16/bfloat16 dtype codes. GIL released in each call.
  m.def("nm_kept_count", &nm_kept_count, py::arg("count"), py::arg("n"), py::arg("m"),
        "Values kept from `count` elements by N:M selection (tail group keeps min(n, L)).");
  m.def("nm_mask_words", &nm_mask_words, py::arg("count"), "64-bit mask words for `count` elements.");
  m.def(
      "nm_mask_popcount",
      [](std::uintptr_t mask, std::size_t count) {
        py::gil_scoped_release release;
        return nm_mask_popcount(static_cast<const std::uint64_t*>(as_pointer(mask)), count);
      },
      py::arg("mask"), py::arg("count"));
  m.def(
      "nm_compress",
      [](std::uintptr_t src, int src_dtype, std::size_t count, int n, int m_, std::uintptr_t values,
         int value_dtype, std::uintptr_t mask, std::uintptr_t residual) {
        const DType st = dtype_from_int(src_dtype), vt = dtype_from_int(value_dtype);
        py::gil_scoped_release release;
        return nm_compress(as_pointer(src), st, count, n, m_, as_pointer(values), vt,
                           static_cast<std::uint64_t*>(as_pointer(mask)),
                           static_cast<float*>(as_pointer(residual)));
      },
      py::arg("src"), py::arg("src_dtype"), py::arg("count"), py::arg("n"), py::arg("m"),
      py::arg("values"), py::arg("value_dtype"), py::arg("mask"), py::arg("residual") = 0,
      "Select n of every m by magnitude; write mask + kept values (and float32 residual if "
      "its address is nonzero). Returns the values written.");
  m.def(
      "nm_select_mask",
      [](std::uintptr_t src, int src_dtype, std::size_t count, int n, int m_, std::uintptr_t mask) {
        const DType st = dtype_from_int(src_dtype);
        py::gil_scoped_release release;
        nm_select_mask(as_pointer(src), st, count, n, m_, static_cast<std::uint64_t*>(as_pointer(mask)));
      },
      py::arg("src"), py::arg("src_dtype"), py::arg("count"), py::arg("n"), py::arg("m"),
      py::arg("mask"), "The mask of N:M selection, without values.");
  m.def(
      "nm_gather",
      [](std::uintptr_t src, int src_dtype, std::size_t count, std::uintptr_t mask,
         std::uintptr_t values, int value_dtype, std::uintptr_t residual) {
        const DType st = dtype_from_int(src_dtype), vt = dtype_from_int(value_dtype);
        py::gil_scoped_release release;
        return nm_gather(as_pointer(src), st, count,
                         static_cast<const std::uint64_t*>(as_pointer(mask)), as_pointer(values),
                         vt, static_cast<float*>(as_pointer(residual)));
      },
      py::arg("src"), py::arg("src_dtype"), py::arg("count"), py::arg("mask"), py::arg("values"),
      py::arg("value_dtype"), py::arg("residual") = 0,
      "Pack the elements whose mask bit is set (select with a given mask).");
  m.def(
      "nm_scatter",
      [](std::uintptr_t values, int value_dtype, std::uintptr_t mask, std::size_t count,
         std::uintptr_t out, int out_dtype) {
        const DType vt = dtype_from_int(value_dtype), ot = dtype_from_int(out_dtype);
        py::gil_scoped_release release;
        return nm_scatter(as_pointer(values), vt, static_cast<const std::uint64_t*>(as_pointer(mask)),
                          count, as_pointer(out), ot);
      },
      py::arg("values"), py::arg("value_dtype"), py::arg("mask"), py::arg("count"), py::arg("out"),
      py::arg("out_dtype") = 0, "Unpack values to their masked positions, zeros elsewhere.");
  m.def(
      "nm_scatter_add",
      [](std::uintptr_t values, int value_dtype, std::uintptr_t mask, std::size_t count,
         std::uintptr_t out) {
        const DType vt = dtype_from_int(value_dtype);
        py::gil_scoped_release release;
        return nm_scatter_add(as_pointer(values), vt,
                              static_cast<const std::uint64_t*>(as_pointer(mask)), count,
                              static_cast<float*>(as_pointer(out)));
      },
      py::arg("values"), py::arg("value_dtype"), py::arg("mask"), py::arg("count"), py::arg("out"),
      "out[i] += value at masked positions (float32 out).");
  m.def(
      "nm_select_by_wait",
      [](std::uintptr_t estimate, std::uintptr_t wait, std::size_t count, int n, int m_,
         std::uintptr_t mask) {
        py::gil_scoped_release release;
        nm_select_by_wait(static_cast<const float*>(as_pointer(estimate)),
                          static_cast<const float*>(as_pointer(wait)), count, n, m_,
                          static_cast<std::uint64_t*>(as_pointer(mask)));
      },
      py::arg("estimate"), py::arg("wait"), py::arg("count"), py::arg("n"), py::arg("m"),
      py::arg("mask"), "Shared mask: N:M selection of |estimate| * (1 + wait).");
  m.def(
      "nm_track",
      [](std::uintptr_t estimate, std::uintptr_t wait, std::uintptr_t reduced, std::uintptr_t mask,
         std::size_t count) {
        py::gil_scoped_release release;
        nm_track(static_cast<float*>(as_pointer(estimate)), static_cast<float*>(as_pointer(wait)),
                 static_cast<const float*>(as_pointer(reduced)),
                 static_cast<const std::uint64_t*>(as_pointer(mask)), count);
      },
      py::arg("estimate"), py::arg("wait"), py::arg("reduced"), py::arg("mask"), py::arg("count"),
      "Shared mask: sent elements take reduced / (1 + wait) and wait 0, others wait + 1.");
  // Cluster-and-hash quantization (cluster_quant.h) of float32 blocks; `values` is a
  // float32/float16/bfloat16 dtype code. GIL released in each call.
  m.def(
      "cluster_payload_bytes",
      [](std::size_t count, int k, std::size_t sample, std::size_t buckets, int values) {
        return cluster_payload_bytes(cluster_config(k, sample, buckets, values), count);
      },
      py::arg("count"), py::arg("k"), py::arg("sample"), py::arg("buckets"), py::arg("values"));
  m.def("cluster_id_bits", &cluster_id_bits, py::arg("k"));
  m.def("cluster_stream", &cluster_stream, py::arg("seed"), py::arg("step"), py::arg("at"),
        "The stream seed of the block at `at` of step `step`.");
  m.def(
      "cluster_encode",
      [](std::uintptr_t x, std::size_t count, int k, std::size_t sample, std::size_t buckets,
         int values, std::uint64_t stream, std::uintptr_t payload, std::uintptr_t residual) {
        const ClusterConfig config = cluster_config(k, sample, buckets, values);
        ClusterEncodeInfo info;
        {
          py::gil_scoped_release release;
          cluster_encode(static_cast<const float*>(as_pointer(x)), count, config, stream,
                         as_pointer(payload), static_cast<float*>(as_pointer(residual)), &info);
        }
        return std::vector<float>(info.centres, info.centres + (count ? k : 0));
      },
      py::arg("x"), py::arg("count"), py::arg("k"), py::arg("sample"), py::arg("buckets"),
      py::arg("values"), py::arg("stream"), py::arg("payload"), py::arg("residual") = 0,
      "Encode `count` float32 into a payload; returns the K-means centres.");
  m.def(
      "cluster_decode",
      [](std::uintptr_t payload, std::size_t count, int k, std::size_t sample,
         std::size_t buckets, int values, std::uintptr_t out, bool add) {
        const ClusterConfig config = cluster_config(k, sample, buckets, values);
        py::gil_scoped_release release;
        cluster_decode(as_pointer(payload), count, config, static_cast<float*>(as_pointer(out)),
                       add);
      },
      py::arg("payload"), py::arg("count"), py::arg("k"), py::arg("sample"), py::arg("buckets"),
      py::arg("values"), py::arg("out"), py::arg("add") = false,
      "Decode a payload into `count` float32 at `out` (add=True: add into it).");
  m.def("cluster_set_vector_level", &cluster_set_vector_level, py::arg("level"),
        "Cluster kernels to use: 0 portable, 1 AVX2 (capped by the CPU); returns the level.");
  m.def("nm_set_vector_level", &nm_set_vector_level, py::arg("level"),
        "N:M kernels to use: 0 portable, 1 AVX2, 2 AVX-512 (capped by the CPU); returns the "
        "level in use.");
  m.def("nm_vector_level_available", &nm_vector_level_available);
#ifdef FUSIONRING_WITH_CUDA
  // Device addresses (e.g. tensor.data_ptr() of CUDA tensors); `stream` is a cudaStream_t.
  m.attr("nm_cuda_built") = true;
  m.def(
      "nm_compress_cuda",
      [](std::uintptr_t src, std::size_t count, int n, int m_, std::uintptr_t values,
         int value_dtype, std::uintptr_t mask, std::uintptr_t residual, std::uintptr_t stream) {
        const DType vt = dtype_from_int(value_dtype);
        py::gil_scoped_release release;
        nm_compress_cuda(static_cast<const float*>(as_pointer(src)), count, n, m_,
                         as_pointer(values), vt, static_cast<std::uint64_t*>(as_pointer(mask)),
                         static_cast<float*>(as_pointer(residual)), as_pointer(stream));
      },
      py::arg("src"), py::arg("count"), py::arg("n"), py::arg("m"), py::arg("values"),
      py::arg("value_dtype"), py::arg("mask"), py::arg("residual") = 0, py::arg("stream") = 0);
  m.def(
      "nm_gather_cuda",
      [](std::uintptr_t src, std::size_t count, int n, int m_, std::uintptr_t mask,
         std::uintptr_t values, int value_dtype, std::uintptr_t residual, std::uintptr_t stream) {
        const DType vt = dtype_from_int(value_dtype);
        py::gil_scoped_release release;
        nm_gather_cuda(static_cast<const float*>(as_pointer(src)), count, n, m_,
                       static_cast<const std::uint64_t*>(as_pointer(mask)), as_pointer(values), vt,
                       static_cast<float*>(as_pointer(residual)), as_pointer(stream));
      },
      py::arg("src"), py::arg("count"), py::arg("n"), py::arg("m"), py::arg("mask"),
      py::arg("values"), py::arg("value_dtype"), py::arg("residual") = 0, py::arg("stream") = 0);
  m.def(
      "nm_scatter_cuda",
      [](std::uintptr_t values, int value_dtype, std::uintptr_t mask, std::size_t count, int n,
         int m_, std::uintptr_t out, bool accumulate, std::uintptr_t stream) {
        const DType vt = dtype_from_int(value_dtype);
        py::gil_scoped_release release;
        nm_scatter_cuda(as_pointer(values), vt, static_cast<const std::uint64_t*>(as_pointer(mask)),
                        count, n, m_, static_cast<float*>(as_pointer(out)), accumulate,
                        as_pointer(stream));
      },
      py::arg("values"), py::arg("value_dtype"), py::arg("mask"), py::arg("count"), py::arg("n"),
      py::arg("m"), py::arg("out"), py::arg("accumulate") = false, py::arg("stream") = 0);
#else
  m.attr("nm_cuda_built") = false;
#endif
}
