// emflow Python module: emflow::reference (the double-precision ground truth) and the exact
// conversion of multi-head attention to an EMF layer (emflow/mha.hpp). Arguments are copied to
// Tensor<double> (these functions allocate their results anyway); results come back as NumPy
// float64 arrays.
#include "emflow/reference.hpp"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "arrays.hpp"
#include "bindings.hpp"
#include "emflow/mha.hpp"

namespace emflow::python {
namespace {

using OptD = std::optional<DoubleArray>;
using Lengths = std::vector<std::int64_t>;

/// The mask from its text, by the library's one parser.
Mask mask_of(const std::string& text) { return parse_mask(text, "mask"); }

nb::object numpy(Tensor<double>&& tensor) { return to_numpy(std::move(tensor)); }

MultiHeadAttentionWeights mha_weights(std::int64_t heads, const DoubleArray& query,
                                      const DoubleArray& key, const DoubleArray& value,
                                      const DoubleArray& output, const OptD& query_bias,
                                      const OptD& key_bias, const OptD& value_bias,
                                      const OptD& output_bias) {
  MultiHeadAttentionWeights w;
  w.heads = heads;
  w.query = to_tensor(query);
  w.key = to_tensor(key);
  w.value = to_tensor(value);
  w.output = to_tensor(output);
  w.query_bias = to_tensor(query_bias);
  w.key_bias = to_tensor(key_bias);
  w.value_bias = to_tensor(value_bias);
  w.output_bias = to_tensor(output_bias);
  // The sizes follow from the projections' shapes; validate() reports any that do not fit.
  if (w.query.rank() == 2 && heads > 0) {
    w.model_dim = w.query.extent(1);
    w.head_dim = w.query.extent(0) / heads;
  }
  if (w.value.rank() == 2 && heads > 0) w.value_dim = w.value.extent(0) / heads;
  return w;
}

}  // namespace

void bind_reference(nb::module_& m) {
  using namespace emflow::reference;
  m.def(
      "ref_relevance_gradients",
      [](const DoubleArray& cloud, const DoubleArray& relevance) {
        return numpy(relevance_gradients(to_tensor(cloud), to_tensor(relevance)));
      },
      nb::arg("cloud"), nb::arg("relevance"));
  m.def(
      "ref_scores",
      [](const DoubleArray& r, const DoubleArray& cloud, const OptD& key_bias, double beta,
         const std::string& mask, const Lengths& lengths) {
        return numpy(scores(to_tensor(r), to_tensor(cloud), to_tensor(key_bias), beta,
                            mask_of(mask), lengths));
      },
      nb::arg("relevance_gradients"), nb::arg("cloud"), nb::arg("key_bias").none(), nb::arg("beta"),
      nb::arg("mask"), nb::arg("key_lengths"));
  m.def(
      "ref_masked_softmax",
      [](const DoubleArray& s) {
        Softmax result = masked_softmax(to_tensor(s));
        return nb::make_tuple(numpy(std::move(result.weights)), numpy(std::move(result.lse)),
                              numpy(std::move(result.entropy)));
      },
      nb::arg("scores"));
  m.def(
      "ref_content",
      [](const DoubleArray& cloud, const DoubleArray& f) {
        return numpy(content(to_tensor(cloud), to_tensor(f)));
      },
      nb::arg("cloud"), nb::arg("content"));
  m.def(
      "ref_contextual_update",
      [](const DoubleArray& weights, const DoubleArray& c, const OptD& offset) {
        return numpy(contextual_update(to_tensor(weights), to_tensor(c), to_tensor(offset)));
      },
      nb::arg("weights"), nb::arg("content"), nb::arg("offset").none());
  m.def(
      "ref_residual_update",
      [](const DoubleArray& cloud, const DoubleArray& update) {
        return numpy(residual_update(to_tensor(cloud), to_tensor(update)));
      },
      nb::arg("cloud"), nb::arg("update"));
  m.def(
      "ref_attend",
      [](const DoubleArray& cloud, const DoubleArray& relevance, const DoubleArray& c,
         const OptD& key_bias, const OptD& offset, double beta, const std::string& mask,
         const Lengths& lengths, bool with_weights) {
        Layer layer{to_tensor(relevance), to_tensor(c), to_tensor(key_bias), to_tensor(offset)};
        Attention result =
            attend(to_tensor(cloud), layer, beta, mask_of(mask), lengths, with_weights);
        nb::object weights = with_weights ? numpy(std::move(result.weights)) : nb::none();
        return nb::make_tuple(numpy(std::move(result.update)), numpy(std::move(result.lse)),
                              numpy(std::move(result.entropy)), weights);
      },
      nb::arg("cloud"), nb::arg("relevance"), nb::arg("content"), nb::arg("key_bias").none(),
      nb::arg("offset").none(), nb::arg("beta"), nb::arg("mask"), nb::arg("key_lengths"),
      nb::arg("with_weights"));
  m.def(
      "mha_to_emf",
      [](std::int64_t heads, const DoubleArray& q, const DoubleArray& k, const DoubleArray& v,
         const DoubleArray& o, const OptD& qb, const OptD& kb, const OptD& vb, const OptD& ob) {
        Layer layer = to_emf(mha_weights(heads, q, k, v, o, qb, kb, vb, ob));
        return nb::make_tuple(numpy(std::move(layer.relevance)), numpy(std::move(layer.content)),
                              numpy(std::move(layer.key_bias)), numpy(std::move(layer.offset)));
      },
      nb::arg("heads"), nb::arg("query"), nb::arg("key"), nb::arg("value"), nb::arg("output"),
      nb::arg("query_bias").none(), nb::arg("key_bias").none(), nb::arg("value_bias").none(),
      nb::arg("output_bias").none());
  m.def(
      "mha_reference",
      [](std::int64_t heads, const DoubleArray& q, const DoubleArray& k, const DoubleArray& v,
         const DoubleArray& o, const OptD& qb, const OptD& kb, const OptD& vb, const OptD& ob,
         const DoubleArray& cloud, const std::string& mask, const Lengths& lengths) {
        return numpy(mha_reference(mha_weights(heads, q, k, v, o, qb, kb, vb, ob), to_tensor(cloud),
                                   mask_of(mask), lengths));
      },
      nb::arg("heads"), nb::arg("query"), nb::arg("key"), nb::arg("value"), nb::arg("output"),
      nb::arg("query_bias").none(), nb::arg("key_bias").none(), nb::arg("value_bias").none(),
      nb::arg("output_bias").none(), nb::arg("cloud"), nb::arg("mask"), nb::arg("key_lengths"));
}

}  // namespace emflow::python
