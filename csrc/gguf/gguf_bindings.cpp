// A GGUF metadata array of strings (a vocabulary's tokens, its merges: tens of thousands of
// length-prefixed values) read in one pass. Each string's length depends on the one before, so
// Python can only read them one at a time, a slow loop over so many values.
#include "gguf/gguf_bindings.h"

#include <Python.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace py = pybind11;

namespace fastllm {
namespace {

uint64_t read_length(const uint8_t* at, bool big_endian) {
  uint64_t length;
  std::memcpy(&length, at, sizeof(length));
  return big_endian ? __builtin_bswap64(length) : length;
}

// [strings, end]: the `count` strings from byte `offset` of `buffer`, each a uint64 length in
// the file's byte order and that many bytes of UTF-8, and the offset just past the last one.
py::tuple read_gguf_strings(const py::buffer& buffer, uint64_t offset, uint64_t count,
                            bool big_endian) {
  const py::buffer_info info = buffer.request();
  if (info.ndim != 1 || info.itemsize != 1 || info.strides[0] != 1)
    throw py::value_error("read_gguf_strings: buffer must be one contiguous run of bytes");
  const auto* data = static_cast<const uint8_t*>(info.ptr);
  const uint64_t size = uint64_t(info.size);
  const std::string end_of_file = ", past the end of the file (" + std::to_string(size) + " bytes)";
  // Each string takes 8 bytes at least: a count the buffer cannot hold fails before the list
  // is allocated.
  if (offset > size || count > (size - offset) / 8)
    throw py::value_error("an array of " + std::to_string(count) + " strings at byte " +
                          std::to_string(offset) + " needs 8 bytes a string at least" +
                          end_of_file);
  const auto past_end = [&](uint64_t i, uint64_t end) {
    return py::value_error("string " + std::to_string(i) + " of the array at byte " +
                           std::to_string(offset) + " reads bytes up to " +
                           std::to_string(end) + end_of_file);
  };
  py::list strings(count);
  uint64_t at = offset;
  for (uint64_t i = 0; i < count; ++i) {
    if (size - at < 8) throw past_end(i, at + 8);
    const uint64_t length = read_length(data + at, big_endian);
    at += 8;
    if (length > size - at) throw past_end(i, at + length);
    PyObject* text = PyUnicode_DecodeUTF8(reinterpret_cast<const char*>(data + at),
                                          Py_ssize_t(length), "strict");
    if (text == nullptr) throw py::error_already_set();  // a UnicodeDecodeError, a ValueError
    PyList_SET_ITEM(strings.ptr(), Py_ssize_t(i), text);  // steals the reference
    at += length;
  }
  return py::make_tuple(std::move(strings), at);
}

}  // namespace

void bind_gguf(py::module_& m) {
  m.def("read_gguf_strings", &read_gguf_strings, py::arg("buffer"), py::arg("offset"),
        py::arg("count"), py::arg("big_endian"),
        "(strings, end): the ``count`` strings of a GGUF metadata array from byte ``offset`` of "
        "``buffer`` (a contiguous bytes-like object: the mapped file), each a uint64 length in "
        "the file's byte order and that many bytes of UTF-8, and the offset past the last one. "
        "A length past the end of the buffer is a ValueError naming where; bytes that are not "
        "UTF-8, a UnicodeDecodeError.");
}

}  // namespace fastllm
