// emflow Python module: GGUF files (emflow/gguf.hpp). The package's layer is emflow.gguf
// (python/emflow/gguf.py); this part hands it the file's metadata, tensor infos and tensors.
//
// Metadata values become Python values: integers int, float32 and float64 float (a float32
// widened exactly), bools bool, strings str (UTF-8, undecodable bytes kept as surrogates:
// s.encode("utf-8", "surrogateescape") gives the stored bytes back), arrays of numbers or bools
// a NumPy array of their type, arrays of strings or of arrays a list.
#include "emflow/gguf.hpp"

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "arrays.hpp"
#include "bindings.hpp"

namespace emflow::python {
namespace {

// The NumPy dtype of a stored number or bool.
const char* numpy_dtype(gguf::ValueType type) {
  switch (type) {
    case gguf::ValueType::uint8:
      return "u1";
    case gguf::ValueType::int8:
      return "i1";
    case gguf::ValueType::uint16:
      return "<u2";
    case gguf::ValueType::int16:
      return "<i2";
    case gguf::ValueType::uint32:
      return "<u4";
    case gguf::ValueType::int32:
      return "<i4";
    case gguf::ValueType::float32:
      return "<f4";
    case gguf::ValueType::boolean:
      return "?";
    case gguf::ValueType::uint64:
      return "<u8";
    case gguf::ValueType::int64:
      return "<i8";
    default:
      return "<f8";
  }
}

nb::object text(const std::string& bytes) {
  PyObject* decoded =
      PyUnicode_DecodeUTF8(bytes.data(), static_cast<Py_ssize_t>(bytes.size()), "surrogateescape");
  if (decoded == nullptr) throw nb::python_error();
  return nb::steal(decoded);
}

nb::object to_python(const gguf::Value& value, const nb::module_& numpy) {
  using gguf::ValueType;
  switch (value.type()) {
    case ValueType::string:
      return text(value.as_string());
    case ValueType::boolean:
      return nb::bool_(value.as_bool());
    case ValueType::float32:
    case ValueType::float64:
      return nb::float_(value.as_double());
    case ValueType::array:
      break;
    default:
      if (value.type() == ValueType::uint64) return nb::int_(value.as_uint64());
      return nb::int_(value.as_int64());
  }
  const ValueType element = value.element_type();
  if (element == ValueType::string) {
    nb::list items;
    for (const std::string& s : value.strings()) items.append(text(s));
    return std::move(items);
  }
  if (element == ValueType::array) {
    nb::list items;
    for (const gguf::Value& a : value.arrays()) items.append(to_python(a, numpy));
    return std::move(items);
  }
  const std::vector<unsigned char>& bytes = value.bytes();
  const nb::bytes raw(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  return numpy.attr("frombuffer")(raw, numpy_dtype(element)).attr("copy")();
}

nb::tuple shape_tuple(const Shape& shape) {
  nb::list extents;
  for (const std::int64_t e : shape) extents.append(e);
  return nb::tuple(extents);
}

}  // namespace

void bind_gguf(nb::module_& m) {
  using gguf::File;
  nb::class_<File>(m, "GgufFile",
                   "emflow::gguf::File: a GGUF file, its metadata and tensor infos read and "
                   "checked once. Use emflow.gguf.File.")
      .def(nb::init<std::string>(), nb::arg("path"), nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("path", &File::path)
      .def_prop_ro("version", &File::version)
      .def_prop_ro("alignment", &File::alignment)
      .def_prop_ro("data_offset", &File::data_offset)
      .def_prop_ro("file_size", &File::file_size)
      .def(
          "metadata",
          [](const File& file) {
            const nb::module_ numpy = nb::module_::import_("numpy");
            nb::list entries;
            for (const gguf::KeyValue& entry : file.metadata()) {
              const gguf::Value& v = entry.value;
              const nb::object element =
                  v.type() == gguf::ValueType::array
                      ? nb::object(nb::str(gguf::to_string(v.element_type())))
                      : nb::none();
              entries.append(nb::make_tuple(text(entry.key), gguf::to_string(v.type()), element,
                                            to_python(v, numpy)));
            }
            return entries;
          },
          "[(key, type, element type or None, value)] in file order.")
      .def(
          "tensors",
          [](const File& file) {
            nb::list infos;
            for (const gguf::TensorInfo& t : file.tensors()) {
              infos.append(nb::make_tuple(text(t.name), gguf::to_string(t.type),
                                          shape_tuple(t.shape), t.offset, t.bytes));
            }
            return infos;
          },
          "[(name, type, shape, offset, nbytes)] in file order; shape row-major.")
      .def(
          "detokenize",
          [](const File& file, const std::vector<std::int64_t>& ids) {
            const std::string text = file.detokenize(ids);
            return nb::bytes(text.data(), text.size());
          },
          nb::arg("ids"), "emflow::gguf::File::detokenize: the text of token ids, as UTF-8 bytes.")
      .def(
          "read",
          [](const File& file, const std::string& name) {
            Tensor<float> tensor;
            {
              nb::gil_scoped_release release;
              tensor = file.read(name);
            }
            return to_numpy(std::move(tensor));
          },
          nb::arg("name"), "emflow::gguf::File::read: the tensor dequantized to float32.");
  m.def(
      "gguf_dequantize",
      [](const std::string& type_name,
         const nb::ndarray<const std::uint8_t, nb::c_contig, nb::device::cpu>& blocks,
         std::int64_t count) {
        gguf::Type type = gguf::Type::f32;
        bool found = false;
        for (std::uint32_t code = 0; code < 64 && !found; ++code) {
          if (type_name == gguf::to_string(static_cast<gguf::Type>(code))) {
            type = static_cast<gguf::Type>(code);
            found = true;
          }
        }
        if (!found) refuse("dequantize", "type", "is '" + type_name + "', not a GGUF type name");
        const std::int64_t block = gguf::block_size(type);
        if (count >= 0 && count % block == 0 &&
            static_cast<std::int64_t>(blocks.size()) != count / block * gguf::block_bytes(type)) {
          refuse("dequantize", "blocks",
                 "has " + std::to_string(blocks.size()) + " bytes; " + std::to_string(count) +
                     " elements of " + type_name + " take " +
                     std::to_string(count / block * gguf::block_bytes(type)));
        }
        Tensor<float> out(Shape{count < 0 ? 0 : count});
        gguf::dequantize(type, blocks.data(), count, out.data());
        return to_numpy(std::move(out));
      },
      nb::arg("type"), nb::arg("blocks"), nb::arg("count"),
      "emflow::gguf::dequantize: `count` elements of the type named `type` (\"Q4_1\", ...) "
      "from their bytes, as float32.");
  m.def(
      "gguf_types",
      []() {
        nb::list types;
        for (std::uint32_t code = 0; code < 64; ++code) {
          const auto type = static_cast<gguf::Type>(code);
          if (gguf::block_size(type) == 0) continue;
          types.append(nb::make_tuple(code, gguf::to_string(type), gguf::block_size(type),
                                      gguf::block_bytes(type), gguf::dequantizes(type)));
        }
        return types;
      },
      "[(code, name, block size, block bytes, dequantized)] for every tensor type emflow knows.");
}

}  // namespace emflow::python
