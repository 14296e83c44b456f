// cuda::AttentionPlan (emflow/cuda.hpp): a problem checked and described once (emflow::Problem),
// routed once (emflow::route for Device::cuda, capability.hpp: the only place that decides what
// runs), given the strategy the route names (plan_strategy.hpp) and bound to the current device;
// then run many times, each run matched against the description with integer compares before the
// strategy enqueues it. Also the workspace cursor and the shared-memory checks the strategies
// share, and detail::PlanAccess (plan_access.hpp). The forms: the update of a dense or factored
// layer, the partial state, and the SDPA-shaped operator's forward and backward passes.
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "core/backends.hpp"
#include "core/check.hpp"
#include "core/low_precision.hpp"
#include "core/sdpa_checks.hpp"
#include "cuda_support.hpp"
#include "decode_strategy.hpp"
#include "emflow/capability.hpp"
#include "emflow/cuda.hpp"
#include "expanded.hpp"
#include "plan_access.hpp"
#include "plan_strategy.hpp"
#include "products_strategy.hpp"
#include "sdpa_strategy.hpp"
#include "tc_dense.hpp"
#include "tc_factored.hpp"

namespace emflow::detail {

std::size_t WorkspaceCursor::take(std::int64_t elements, std::size_t element_bytes,
                                  const char* region) {
  const std::size_t offset =
      (cursor_ + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
  const std::int64_t bytes =
      checked_multiply(operation_, region, elements, static_cast<std::int64_t>(element_bytes));
  if (static_cast<std::size_t>(bytes) > SIZE_MAX - kWorkspaceAlignment - offset) {
    fail_argument(operation_, region, "workspace size overflows size_t");
  }
  cursor_ = offset + static_cast<std::size_t>(bytes);
  return offset;
}

int shared_memory_limit(int device, const char* operation) {
  int limit = 0;
  check_cuda(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
             operation, "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)");
  return limit;
}

void expect_shared_memory(const char* operation, const char* kernel, std::size_t needed, int device,
                          int limit, const char* alternative) {
  if (needed <= static_cast<std::size_t>(limit)) return;
  fail(ErrorCode::unsupported, operation, ": ", kernel, " needs ", needed,
       " bytes of shared memory per block here; device ", device, " allows ", limit,
       " (cudaDevAttrMaxSharedMemoryPerBlockOptin): ", alternative);
}

}  // namespace emflow::detail

namespace emflow::cuda {

namespace detail {

template <class T>
struct PlanState {
  std::string operation;  // names the plan's errors, when made and when run
  Problem problem;        // what the plan was made for (Problem::lse etc.: the outputs asked)
  Route route;
  int device = -1;  // -1: sized only (get_workspace_size), never run
  std::unique_ptr<emflow::detail::PlanStrategy<T>> strategy;
  emflow::detail::SdpaBackwardForm backward;  // Operation::sdpa_backward only
};

}  // namespace detail

namespace {

using emflow::detail::fail;
using emflow::detail::fail_argument;
using emflow::detail::PlanStrategy;

// What a plan is made for: to run (the device readied), to answer can_implement (the device's
// limits read, nothing set), or to be sized (no device).
enum class Purpose { run, check, size };

constexpr const char* kPlan = "cuda::AttentionPlan";

void check_options(const PlanOptions& options, const char* operation) {
  switch (options.algorithm) {
    case Algorithm::automatic:
    case Algorithm::fused:
    case Algorithm::unfused:
      break;
    default:
      fail_argument(operation, "algorithm", "is not an Algorithm, got ",
                    static_cast<int>(options.algorithm));
  }
  if (options.key_splits < 0) {
    fail_argument(operation, "key_splits", "must be >= 0 (0 chooses), got ", options.key_splits);
  }
}

template <class T>
ExecutionOptions execution(const PlanOptions& options, const char* operation) {
  check_options(options, operation);
  ExecutionOptions exec;
  exec.device = Device::cuda;
  exec.precision = options.precision;
  // A precision the storage type cannot honour is an invalid argument, named as such.
  emflow::detail::check_precision<T>(exec, operation);
  return exec;
}

// The Problem of each form, after the checks that read no array (shapes, sizes, beta, the mask,
// the options).
template <class T>
Problem checked_problem(const char* operation, const AttentionInput<T>& input,
                        const AttentionOutput<T>& output, const PlanOptions& options) {
  const ExecutionOptions exec = execution<T>(options, operation);
  emflow::detail::check_shapes(input, output, operation);
  Problem p = describe(input, output, exec);
  p.algorithm = options.algorithm;
  return p;
}

template <class T>
Problem checked_problem(const char* operation, const AttentionInput<T>& input,
                        const FactoredLayer<T>& layer, const AttentionOutput<T>& output,
                        const PlanOptions& options) {
  const ExecutionOptions exec = execution<T>(options, operation);
  if (input.layer.relevance != nullptr || input.layer.content != nullptr ||
      input.layer.key_bias != nullptr || input.layer.offset != nullptr) {
    fail_argument(operation, "input.layer",
                  "must be empty (null pointers): the operators come from 'layer'");
  }
  emflow::detail::expect_positive(operation, "heads", layer.heads);
  emflow::detail::expect_positive(operation, "rank", layer.rank);
  if (input.dim >= 1) {
    emflow::detail::checked_multiply(
        operation, "query_factor",
        emflow::detail::checked_multiply(operation, "query_factor", layer.heads, layer.rank),
        input.dim);
  }
  // The shapes as a dense layer of these heads would have them (the sizes of the expanded
  // operators included).
  AttentionInput<T> shapes = input;
  shapes.layer.heads = layer.heads;
  emflow::detail::check_shapes(shapes, output, operation);
  Problem p = describe(input, layer, output, exec);
  p.algorithm = options.algorithm;
  return p;
}

template <class T>
Problem checked_problem(const char* operation, const AttentionInput<T>& input,
                        const PartialOutput<T>& output, const PlanOptions& options) {
  const ExecutionOptions exec = execution<T>(options, operation);
  emflow::detail::check_shapes(input, AttentionOutput<T>{}, operation);
  Problem p = describe(input, output, exec);
  p.algorithm = options.algorithm;
  p.lse = p.entropy = true;  // every array of a partial state is written
  return p;
}

// The SDPA-shaped operator's checks of its shapes, scale and mask. A plan reads no array: null
// queries, keys, values or outputs stand in for arrays given at each run (which checks them).
template <class T>
void check_sdpa_shapes(const char* operation, const SdpaInput<T>& input) {
  static const T stand_in{};
  SdpaInput<T> shapes = input;
  if (shapes.queries == nullptr) shapes.queries = &stand_in;
  if (shapes.keys == nullptr) shapes.keys = &stand_in;
  if (shapes.values == nullptr) shapes.values = &stand_in;
  T written{};
  emflow::detail::check_sdpa(shapes, &written, operation, emflow::detail::Lengths::device);
}

// The SDPA-shaped operator's forward pass.
template <class T>
Problem checked_problem(const char* operation, const SdpaInput<T>& input,
                        const SdpaOutput<T>& output, const PlanOptions& options) {
  const ExecutionOptions exec = execution<T>(options, operation);
  check_sdpa_shapes(operation, input);
  Problem p = emflow::detail::sdpa_problem(input, Operation::sdpa, exec);
  p.algorithm = options.algorithm;
  p.lse = output.lse != nullptr;
  p.entropy = output.entropy != nullptr;
  return p;
}

// The SDPA-shaped operator's backward pass, with what it is made with beyond the Problem.
template <class T>
Problem checked_problem(const char* operation, const SdpaInput<T>& input,
                        const UpstreamGradients<T>& upstream,
                        const SdpaGradientOutput<T>& gradients, const SdpaBackwardOptions& options,
                        emflow::detail::SdpaBackwardForm* form) {
  const ExecutionOptions exec = execution<T>(PlanOptions{}, operation);
  check_sdpa_shapes(operation, input);
  Problem p = emflow::detail::sdpa_problem(input, Operation::sdpa_backward, exec);
  form->update = upstream.update != nullptr;
  form->lse = upstream.lse != nullptr;
  form->entropy = upstream.entropy != nullptr;
  form->scale = gradients.scale != nullptr;
  form->deterministic = options.deterministic;
  return p;
}

// A machine with a device: the rules of route() do not depend on which device it is.
Machine with_device() {
  Machine machine = this_machine();
  machine.cuda_device = machine.cuda_built;
  machine.cuda_reason.clear();
  return machine;
}

// The strategy route() names for `p` (validated and supported).
template <class T>
std::unique_ptr<PlanStrategy<T>> make_strategy(const Problem& p, const Route& r, int key_splits,
                                               const emflow::detail::SdpaBackwardForm& backward,
                                               const char* operation) {
  using namespace emflow::detail;
  constexpr bool wide = std::is_same_v<T, float> || std::is_same_v<T, double>;
  constexpr bool tensor_cores = !std::is_same_v<T, double>;
  if (p.operation == Operation::sdpa_backward) {
    if constexpr (tensor_cores) {
      return std::make_unique<SdpaBackwardStrategy<T>>(p, backward, operation);
    }
  } else if (p.operation == Operation::sdpa) {
    if constexpr (tensor_cores) {
      if (!r.expanded &&
          (r.kernel == Kernel::cuda_tensor_cores || r.kernel == Kernel::cuda_fused)) {
        return std::make_unique<SdpaStrategy<T>>(p, r.kernel, key_splits, operation);
      }
    }
  } else if (r.kernel == Kernel::cuda_tensor_cores && !r.expanded) {
    if constexpr (tensor_cores) {
      if (p.form == Form::factored) {
        return std::make_unique<TcFactoredStrategy<T>>(p, key_splits, operation);
      }
      return std::make_unique<TcDenseStrategy<T>>(p, key_splits, operation);
    }
  } else if (r.expanded) {
    if constexpr (wide) {
      Problem dense = p;
      dense.form = Form::dense;
      Route inner = r;
      inner.expanded = false;
      return std::make_unique<ExpandedStrategy<T>>(
          p, make_strategy<T>(dense, inner, key_splits, backward, operation), operation);
    }
  } else if (r.kernel == Kernel::cuda_fused && p.form == Form::factored) {
    // A rotary or grouped layer in float32, never expanded: its projections and the SDPA
    // operator's float32 kernel (tc_factored.cpp).
    if constexpr (std::is_same_v<T, float>) {
      return std::make_unique<TcFactoredStrategy<T>>(p, key_splits, operation);
    }
  } else if (r.kernel == Kernel::cuda_fused || r.kernel == Kernel::cuda_unfused) {
    if constexpr (wide) {
      return std::make_unique<ProductsStrategy<T>>(p, r.kernel, key_splits, operation);
    }
  }
  fail(ErrorCode::internal, operation, ": no CUDA strategy for the route '", to_string(r), "'");
}

// The route of `p`: what the problem needs first (so that a refusal reads the same with and
// without a device), then, unless the plan is only sized, the device itself, as route() says it.
Route route_for(const Problem& p, Purpose purpose, const char* operation) {
  Route r = route(p, Device::cuda, with_device(), operation);
  if (!r.supported || purpose == Purpose::size || this_machine().cuda_device) return r;
  return route(p, Device::cuda, this_machine(), operation);
}

template <class T>
std::unique_ptr<detail::PlanState<T>> make_state(
    const char* operation, const Problem& p, const PlanOptions& options, Purpose purpose,
    const emflow::detail::SdpaBackwardForm& backward = {}) {
  auto state = std::make_unique<detail::PlanState<T>>();
  state->operation = operation;
  state->problem = p;
  state->backward = backward;
  state->route = route_for(p, purpose, operation);
  if (!state->route.supported) fail(ErrorCode::unsupported, state->route.reason);
  state->strategy = make_strategy<T>(p, state->route, options.key_splits, backward, operation);
  if (purpose != Purpose::size) {
    // Refuses an error already pending: the strategy's queries report failures through the last
    // error, so one left by the caller is named as the caller's.
    state->device = emflow::detail::current_device(operation);
    state->strategy->bind(state->device, purpose == Purpose::run, operation);
  }
  return state;
}

template <class T, class... Form>
Route can_implement_form(const Form&... form) noexcept {
  try {
    const Problem p = checked_problem(kPlan, form...);
    // The options are the last argument of every form.
    const PlanOptions& options = std::get<sizeof...(Form) - 1>(std::tie(form...));
    const Route r = route_for(p, Purpose::check, kPlan);
    if (!r.supported) return r;
    (void)make_state<T>(kPlan, p, options, Purpose::check);
    return r;
  } catch (const Error& e) {
    Route refused;
    refused.device = Device::cuda;
    refused.reason = e.what();
    return refused;
  } catch (...) {
    Route refused;
    refused.device = Device::cuda;
    refused.reason = std::string(kPlan) + ": out of memory while planning";
    return refused;
  }
}

// The backward's can_implement: as can_implement_form, with its form.
template <class T>
Route can_implement_backward(const SdpaInput<T>& input, const UpstreamGradients<T>& upstream,
                             const SdpaGradientOutput<T>& gradients,
                             const SdpaBackwardOptions& options) noexcept {
  try {
    emflow::detail::SdpaBackwardForm form;
    const Problem p = checked_problem(kPlan, input, upstream, gradients, options, &form);
    const Route r = route_for(p, Purpose::check, kPlan);
    if (!r.supported) return r;
    (void)make_state<T>(kPlan, p, PlanOptions{}, Purpose::check, form);
    return r;
  } catch (const Error& e) {
    Route refused;
    refused.device = Device::cuda;
    refused.reason = e.what();
    return refused;
  } catch (...) {
    Route refused;
    refused.device = Device::cuda;
    refused.reason = std::string(kPlan) + ": out of memory while planning";
    return refused;
  }
}

const char* presence(bool present) { return present ? "given" : "null"; }

// The form of a run against the form of its plan.
void check_form(const Problem& planned, Operation operation, Form form, const char* op) {
  if (planned.operation == Operation::decode) {
    fail_argument(op, "plan", "belongs to a decode cache, which runs its own calls");
  }
  const auto sdpa = [](Operation o) {
    return o == Operation::sdpa || o == Operation::sdpa_backward;
  };
  if (sdpa(planned.operation) != sdpa(operation)) {
    fail_argument(op, "input",
                  sdpa(planned.operation)
                      ? "must be an SdpaInput: the plan was made for the SDPA-shaped operator"
                      : "must be an AttentionInput: the plan was made for an attention layer");
  }
  if (sdpa(operation) && planned.operation != operation) {
    fail_argument(op, "plan",
                  planned.operation == Operation::sdpa
                      ? "was made for the SDPA operator's forward pass (run it with an SdpaOutput)"
                      : "was made for the SDPA operator's backward pass (run it with the saved "
                        "forward, the upstream gradients and the gradients)");
  }
  if (planned.operation != operation) {
    fail_argument(op, "output",
                  planned.operation == Operation::partial
                      ? "must be a PartialOutput: the plan was made for the partial state"
                      : "must be an AttentionOutput: the plan was made for the update");
  }
  if (planned.form != form) {
    fail_argument(op, "layer",
                  planned.form == Form::factored
                      ? "is missing: the plan was made for a factored layer (run it with the "
                        "FactoredLayer)"
                      : "must not be given: the plan was made for a dense layer");
  }
}

// The first difference between a run's Problem and its plan's: false, or an invalid_argument
// naming it when `raise`.
bool same_problem(const Problem& planned, const Problem& given, const char* op, bool raise) {
  // kv_heads and rotary.dim too: the tensor-core strategy lays out kv_heads keys and values and
  // turns rotary.dim coordinates of the queries and keys (the pairing, base and scaling are read
  // from the run's layer).
  const std::int64_t planned_sizes[] = {planned.batch,    planned.tokens,    planned.query_tokens,
                                        planned.dim,      planned.heads,     planned.rank,
                                        planned.kv_heads, planned.rotary_dim};
  const std::int64_t given_sizes[] = {given.batch,    given.tokens,    given.query_tokens,
                                      given.dim,      given.heads,     given.rank,
                                      given.kv_heads, given.rotary_dim};
  // The SDPA-shaped operator keeps its value rank in dim and its query heads in heads.
  const bool sdpa =
      planned.operation == Operation::sdpa || planned.operation == Operation::sdpa_backward;
  const char* const size_names[] = {"batch",
                                    "tokens",
                                    "query_tokens",
                                    sdpa ? "value_rank" : "dim",
                                    sdpa ? "query_heads" : "heads",
                                    "rank",
                                    "kv_heads",
                                    "rotary.dim"};
  for (int k = 0; k < 8; ++k) {
    if (given_sizes[k] == planned_sizes[k]) continue;
    if (!raise) return false;
    fail_argument(op, size_names[k], "is ", given_sizes[k], ", but the plan was made for ",
                  planned_sizes[k]);
  }
  if (given.mask.kind != planned.mask.kind ||
      (planned.mask.kind == MaskKind::window && given.mask.window != planned.mask.window)) {
    if (!raise) return false;
    fail_argument(op, "mask", "is ", to_string(given.mask), ", but the plan was made for ",
                  to_string(planned.mask));
  }
  // The optional arrays that change what a strategy computes or lays out.
  const bool planned_arrays[] = {planned.cross, planned.key_bias, planned.rotary_positions,
                                 planned.lse,   planned.entropy,  planned.weights};
  const bool given_arrays[] = {given.cross, given.key_bias, given.rotary_positions,
                               given.lse,   given.entropy,  given.weights};
  const char* const array_names[] = {
      "queries", "key_bias", "rotary.key_positions or query_positions",
      "lse",     "entropy",  "weights"};
  const int arrays = planned.operation == Operation::partial ? 3 : 6;
  for (int k = 0; k < arrays; ++k) {
    if (given_arrays[k] == planned_arrays[k]) continue;
    if (!raise) return false;
    fail_argument(op, array_names[k], "is ", presence(given_arrays[k]),
                  ", but the plan was made with it ", presence(planned_arrays[k]));
  }
  return true;
}

void check_workspace(const void* workspace, std::size_t bytes, std::size_t needed, const char* op) {
  if (workspace == nullptr && needed == 0) return;
  if (workspace == nullptr) fail_argument(op, "workspace", "must not be null");
  if (bytes < needed) {
    fail_argument(op, "workspace_bytes", "must be >= ", needed,
                  " (the plan's workspace_size()), got ", bytes);
  }
  if (reinterpret_cast<std::uintptr_t>(workspace) % emflow::detail::kWorkspaceAlignment != 0) {
    fail_argument(op, "workspace", "must be aligned to ", emflow::detail::kWorkspaceAlignment,
                  " bytes, got address ", workspace);
  }
}

template <class T>
const detail::PlanState<T>& state_of(const std::unique_ptr<detail::PlanState<T>>& state) {
  if (!state) fail_argument(kPlan, "plan", "was moved from");
  return *state;
}

// After the run's own checks: the workspace, then the device binding and the enqueue.
template <class T>
void enqueue(const detail::PlanState<T>& s, const emflow::detail::PlanCall<T>& call,
             void* workspace, std::size_t workspace_bytes, Stream stream) {
  const char* const op = s.operation.c_str();
  check_workspace(workspace, workspace_bytes, s.strategy->workspace_bytes(), op);
  emflow::detail::check_no_pending_error(op);
  const emflow::detail::DeviceGuard on_device(s.device, op);
  emflow::detail::expect_stream_of(op, stream, s.device);
  s.strategy->run(call, static_cast<unsigned char*>(workspace), stream, op);
}

}  // namespace

template <class T>
AttentionPlan<T>::AttentionPlan(std::unique_ptr<detail::PlanState<T>> state) noexcept
    : state_(std::move(state)) {}

template <class T>
AttentionPlan<T>::AttentionPlan(const AttentionInput<T>& input, const AttentionOutput<T>& output,
                                const PlanOptions& options)
    : state_(make_state<T>(kPlan, checked_problem(kPlan, input, output, options), options,
                           Purpose::run)) {}

template <class T>
AttentionPlan<T>::AttentionPlan(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                                const AttentionOutput<T>& output, const PlanOptions& options)
    : state_(make_state<T>(kPlan, checked_problem(kPlan, input, layer, output, options), options,
                           Purpose::run)) {}

template <class T>
AttentionPlan<T>::AttentionPlan(const AttentionInput<T>& input, const PartialOutput<T>& output,
                                const PlanOptions& options)
    : state_(make_state<T>(kPlan, checked_problem(kPlan, input, output, options), options,
                           Purpose::run)) {}

template <class T>
AttentionPlan<T>::AttentionPlan(const SdpaInput<T>& input, const SdpaOutput<T>& output,
                                const PlanOptions& options)
    : state_(make_state<T>(kPlan, checked_problem(kPlan, input, output, options), options,
                           Purpose::run)) {}

template <class T>
AttentionPlan<T>::AttentionPlan(const SdpaInput<T>& input, const UpstreamGradients<T>& upstream,
                                const SdpaGradientOutput<T>& gradients,
                                const SdpaBackwardOptions& options)
    : state_(
          std::move(detail::PlanAccess::make(kPlan, input, upstream, gradients, options).state_)) {}

template <class T>
AttentionPlan<T>::~AttentionPlan() = default;
template <class T>
AttentionPlan<T>::AttentionPlan(AttentionPlan&&) noexcept = default;
template <class T>
AttentionPlan<T>& AttentionPlan<T>::operator=(AttentionPlan&&) noexcept = default;

template <class T>
Route AttentionPlan<T>::can_implement(const AttentionInput<T>& input,
                                      const AttentionOutput<T>& output,
                                      const PlanOptions& options) noexcept {
  return can_implement_form<T>(input, output, options);
}

template <class T>
Route AttentionPlan<T>::can_implement(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                                      const AttentionOutput<T>& output,
                                      const PlanOptions& options) noexcept {
  return can_implement_form<T>(input, layer, output, options);
}

template <class T>
Route AttentionPlan<T>::can_implement(const AttentionInput<T>& input,
                                      const PartialOutput<T>& output,
                                      const PlanOptions& options) noexcept {
  return can_implement_form<T>(input, output, options);
}

template <class T>
Route AttentionPlan<T>::can_implement(const SdpaInput<T>& input, const SdpaOutput<T>& output,
                                      const PlanOptions& options) noexcept {
  return can_implement_form<T>(input, output, options);
}

template <class T>
Route AttentionPlan<T>::can_implement(const SdpaInput<T>& input,
                                      const UpstreamGradients<T>& upstream,
                                      const SdpaGradientOutput<T>& gradients,
                                      const SdpaBackwardOptions& options) noexcept {
  return can_implement_backward<T>(input, upstream, gradients, options);
}

template <class T>
std::size_t AttentionPlan<T>::get_workspace_size(const AttentionInput<T>& input,
                                                 const AttentionOutput<T>& output,
                                                 const PlanOptions& options) {
  return detail::PlanAccess::workspace_size(kPlan, input, output, options);
}

template <class T>
std::size_t AttentionPlan<T>::get_workspace_size(const AttentionInput<T>& input,
                                                 const FactoredLayer<T>& layer,
                                                 const AttentionOutput<T>& output,
                                                 const PlanOptions& options) {
  return detail::PlanAccess::workspace_size(kPlan, input, layer, output, options);
}

template <class T>
std::size_t AttentionPlan<T>::get_workspace_size(const AttentionInput<T>& input,
                                                 const PartialOutput<T>& output,
                                                 const PlanOptions& options) {
  return detail::PlanAccess::workspace_size(kPlan, input, output, options);
}

template <class T>
std::size_t AttentionPlan<T>::get_workspace_size(const SdpaInput<T>& input,
                                                 const SdpaOutput<T>& output,
                                                 const PlanOptions& options) {
  return detail::PlanAccess::workspace_size(kPlan, input, output, options);
}

template <class T>
std::size_t AttentionPlan<T>::get_workspace_size(const SdpaInput<T>& input,
                                                 const UpstreamGradients<T>& upstream,
                                                 const SdpaGradientOutput<T>& gradients,
                                                 const SdpaBackwardOptions& options) {
  return detail::PlanAccess::workspace_size(kPlan, input, upstream, gradients, options);
}

template <class T>
std::size_t AttentionPlan<T>::workspace_size() const noexcept {
  return state_ ? state_->strategy->workspace_bytes() : 0;
}

template <class T>
const Route& AttentionPlan<T>::route() const noexcept {
  static const Route none;
  return state_ ? state_->route : none;
}

template <class T>
int AttentionPlan<T>::device() const noexcept {
  return state_ ? state_->device : -1;
}

template <class T>
int AttentionPlan<T>::key_splits() const noexcept {
  return state_ ? state_->strategy->key_splits() : 1;
}

template <class T>
bool AttentionPlan<T>::matches(const AttentionInput<T>& input,
                               const AttentionOutput<T>& output) const noexcept {
  if (!state_) return false;
  const Problem& planned = state_->problem;
  try {  // describe() reads no array; an allocation failure of its strings reads as no match
    return planned.operation == Operation::update && planned.form == Form::dense &&
           output.update != nullptr && same_problem(planned, describe(input, output), "", false);
  } catch (...) {
    return false;
  }
}

template <class T>
bool AttentionPlan<T>::matches(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                               const AttentionOutput<T>& output) const noexcept {
  if (!state_) return false;
  const Problem& planned = state_->problem;
  try {  // as above
    return planned.operation == Operation::update && planned.form == Form::factored &&
           output.update != nullptr &&
           same_problem(planned, describe(input, layer, output), "", false);
  } catch (...) {
    return false;
  }
}

template <class T>
bool AttentionPlan<T>::matches(const AttentionInput<T>& input,
                               const PartialOutput<T>& output) const noexcept {
  if (!state_) return false;
  const Problem& planned = state_->problem;
  try {  // as above
    return planned.operation == Operation::partial && output.heads != nullptr &&
           output.lse != nullptr && output.entropy != nullptr &&
           same_problem(planned, describe(input, output), "", false);
  } catch (...) {
    return false;
  }
}

template <class T>
bool AttentionPlan<T>::matches(const SdpaInput<T>& input,
                               const SdpaOutput<T>& output) const noexcept {
  if (!state_) return false;
  const Problem& planned = state_->problem;
  if (planned.operation != Operation::sdpa || output.output == nullptr) return false;
  try {  // an allocation failure of a message's strings reads as no match
    Problem given = emflow::detail::sdpa_problem(input, Operation::sdpa, ExecutionOptions{});
    given.lse = output.lse != nullptr;
    given.entropy = output.entropy != nullptr;
    return same_problem(planned, given, "", false);
  } catch (...) {
    return false;
  }
}

namespace {

// The first difference between a backward call's arrays and its plan's form: false, or an
// invalid_argument naming it when `raise`.
template <class T>
bool same_backward_form(const emflow::detail::SdpaBackwardForm& planned,
                        const UpstreamGradients<T>& upstream,
                        const SdpaGradientOutput<T>& gradients, const char* op, bool raise) {
  const bool planned_arrays[] = {planned.update, planned.lse, planned.entropy, planned.scale};
  const bool given_arrays[] = {upstream.update != nullptr, upstream.lse != nullptr,
                               upstream.entropy != nullptr, gradients.scale != nullptr};
  const char* const names[] = {"upstream.update", "upstream.lse", "upstream.entropy",
                               "gradients.scale"};
  for (int k = 0; k < 4; ++k) {
    if (given_arrays[k] == planned_arrays[k]) continue;
    if (!raise) return false;
    fail_argument(op, names[k], "is ", presence(given_arrays[k]),
                  ", but the plan was made with it ", presence(planned_arrays[k]));
  }
  return true;
}

}  // namespace

template <class T>
bool AttentionPlan<T>::matches(const SdpaInput<T>& input, const SdpaSaved<T>& saved,
                               const UpstreamGradients<T>& upstream,
                               const SdpaGradientOutput<T>& gradients) const noexcept {
  if (!state_) return false;
  const Problem& planned = state_->problem;
  if (planned.operation != Operation::sdpa_backward || gradients.queries == nullptr ||
      gradients.keys == nullptr || gradients.values == nullptr || saved.lse == nullptr ||
      (upstream.update != nullptr && saved.output == nullptr) ||
      (upstream.entropy != nullptr && saved.entropy == nullptr)) {
    return false;
  }
  try {  // an allocation failure of a message's strings reads as no match
    return same_problem(
               planned,
               emflow::detail::sdpa_problem(input, Operation::sdpa_backward, ExecutionOptions{}),
               "", false) &&
           same_backward_form(state_->backward, upstream, gradients, "", false);
  } catch (...) {
    return false;
  }
}

// Each run: its form, its match with the plan, and the validator of emflow::attend (or
// attend_factored) for device arrays, whose checks are integer compares (the shapes, positions,
// beta, the mask, the required arrays not null; the length values are not read), then enqueue.
template <class T>
void AttentionPlan<T>::run(const AttentionInput<T>& input, const AttentionOutput<T>& output,
                           void* workspace, std::size_t workspace_bytes, Stream stream) const {
  const detail::PlanState<T>& s = state_of(state_);
  const char* const op = s.operation.c_str();
  check_form(s.problem, Operation::update, Form::dense, op);
  same_problem(s.problem, describe(input, output), op, true);
  emflow::detail::check_arguments(input, output, op, emflow::detail::Lengths::device);
  emflow::detail::PlanCall<T> call;
  call.input = &input;
  call.output = &output;
  enqueue(s, call, workspace, workspace_bytes, stream);
}

template <class T>
void AttentionPlan<T>::run(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                           const AttentionOutput<T>& output, void* workspace,
                           std::size_t workspace_bytes, Stream stream) const {
  const detail::PlanState<T>& s = state_of(state_);
  const char* const op = s.operation.c_str();
  check_form(s.problem, Operation::update, Form::factored, op);
  same_problem(s.problem, describe(input, layer, output), op, true);
  emflow::detail::check_factored(input, layer, output, op, nullptr, 0,
                                 emflow::detail::Lengths::device);
  emflow::detail::PlanCall<T> call;
  call.input = &input;
  call.layer = &layer;
  call.output = &output;
  enqueue(s, call, workspace, workspace_bytes, stream);
}

template <class T>
void AttentionPlan<T>::run(const AttentionInput<T>& input, const PartialOutput<T>& output,
                           void* workspace, std::size_t workspace_bytes, Stream stream) const {
  const detail::PlanState<T>& s = state_of(state_);
  const char* const op = s.operation.c_str();
  check_form(s.problem, Operation::partial, Form::dense, op);
  same_problem(s.problem, describe(input, output), op, true);
  emflow::detail::expect_not_null(op, "heads", output.heads);
  emflow::detail::expect_not_null(op, "lse", output.lse);
  emflow::detail::expect_not_null(op, "entropy", output.entropy);
  // The update's checks, with the partial state's rows standing in for the update.
  AttentionOutput<T> as_update;
  as_update.update = output.heads;
  emflow::detail::check_arguments(input, as_update, op, emflow::detail::Lengths::device);
  emflow::detail::PlanCall<T> call;
  call.input = &input;
  call.partial = &output;
  enqueue(s, call, workspace, workspace_bytes, stream);
}

// The SDPA form: the validator of emflow::sdpa_attend for device arrays (integer compares; the
// output required), then the match with the plan.
template <class T>
void AttentionPlan<T>::run(const SdpaInput<T>& input, const SdpaOutput<T>& output, void* workspace,
                           std::size_t workspace_bytes, Stream stream) const {
  const detail::PlanState<T>& s = state_of(state_);
  const char* const op = s.operation.c_str();
  check_form(s.problem, Operation::sdpa, Form::factored, op);
  emflow::detail::check_sdpa(input, output.output, op, emflow::detail::Lengths::device);
  Problem given = emflow::detail::sdpa_problem(input, Operation::sdpa, ExecutionOptions{});
  given.lse = output.lse != nullptr;
  given.entropy = output.entropy != nullptr;
  same_problem(s.problem, given, op, true);
  emflow::detail::PlanCall<T> call;
  call.sdpa = &input;
  call.sdpa_output = &output;
  enqueue(s, call, workspace, workspace_bytes, stream);
}

// The SDPA backward: the blocking form's checks for device arrays (integer compares; the gradients
// and the saved arrays a given upstream gradient needs not null), then the match with the plan.
template <class T>
void AttentionPlan<T>::run(const SdpaInput<T>& input, const SdpaSaved<T>& saved,
                           const UpstreamGradients<T>& upstream,
                           const SdpaGradientOutput<T>& gradients, void* workspace,
                           std::size_t workspace_bytes, Stream stream) const {
  const detail::PlanState<T>& s = state_of(state_);
  const char* const op = s.operation.c_str();
  check_form(s.problem, Operation::sdpa_backward, Form::factored, op);
  emflow::detail::check_sdpa(input, gradients.queries, op, emflow::detail::Lengths::device);
  emflow::detail::expect_not_null(op, "gradients.keys", gradients.keys);
  emflow::detail::expect_not_null(op, "gradients.values", gradients.values);
  emflow::detail::expect_not_null(op, "saved.lse", saved.lse);
  if (upstream.update != nullptr) {
    emflow::detail::expect_not_null(op, "saved.output", saved.output);
  }
  if (upstream.entropy != nullptr) {
    emflow::detail::expect_not_null(op, "saved.entropy", saved.entropy);
  }
  same_problem(s.problem,
               emflow::detail::sdpa_problem(input, Operation::sdpa_backward, ExecutionOptions{}),
               op, true);
  same_backward_form(s.backward, upstream, gradients, op, true);
  emflow::detail::PlanCall<T> call;
  call.sdpa = &input;
  call.saved = &saved;
  call.upstream = &upstream;
  call.gradients = &gradients;
  enqueue(s, call, workspace, workspace_bytes, stream);
}

template class AttentionPlan<float>;
template class AttentionPlan<double>;
template class AttentionPlan<bfloat16>;
template class AttentionPlan<float16>;

namespace detail {

template <class T>
AttentionPlan<T> PlanAccess::make(const char* operation, const AttentionInput<T>& input,
                                  const AttentionOutput<T>& output, const PlanOptions& options) {
  return AttentionPlan<T>(make_state<T>(
      operation, checked_problem(operation, input, output, options), options, Purpose::run));
}

template <class T>
AttentionPlan<T> PlanAccess::make(const char* operation, const AttentionInput<T>& input,
                                  const FactoredLayer<T>& layer, const AttentionOutput<T>& output,
                                  const PlanOptions& options) {
  return AttentionPlan<T>(make_state<T>(
      operation, checked_problem(operation, input, layer, output, options), options, Purpose::run));
}

template <class T>
AttentionPlan<T> PlanAccess::make(const char* operation, const AttentionInput<T>& input,
                                  const PartialOutput<T>& output, const PlanOptions& options) {
  return AttentionPlan<T>(make_state<T>(
      operation, checked_problem(operation, input, output, options), options, Purpose::run));
}

template <class T>
std::size_t PlanAccess::workspace_size(const char* operation, const AttentionInput<T>& input,
                                       const AttentionOutput<T>& output,
                                       const PlanOptions& options) {
  return make_state<T>(operation, checked_problem(operation, input, output, options), options,
                       Purpose::size)
      ->strategy->workspace_bytes();
}

template <class T>
std::size_t PlanAccess::workspace_size(const char* operation, const AttentionInput<T>& input,
                                       const FactoredLayer<T>& layer,
                                       const AttentionOutput<T>& output,
                                       const PlanOptions& options) {
  return make_state<T>(operation, checked_problem(operation, input, layer, output, options),
                       options, Purpose::size)
      ->strategy->workspace_bytes();
}

template <class T>
std::size_t PlanAccess::workspace_size(const char* operation, const AttentionInput<T>& input,
                                       const PartialOutput<T>& output, const PlanOptions& options) {
  return make_state<T>(operation, checked_problem(operation, input, output, options), options,
                       Purpose::size)
      ->strategy->workspace_bytes();
}

template <class T>
AttentionPlan<T> PlanAccess::make(const char* operation, const SdpaInput<T>& input,
                                  const SdpaOutput<T>& output, const PlanOptions& options) {
  return AttentionPlan<T>(make_state<T>(
      operation, checked_problem(operation, input, output, options), options, Purpose::run));
}

template <class T>
std::size_t PlanAccess::workspace_size(const char* operation, const SdpaInput<T>& input,
                                       const SdpaOutput<T>& output, const PlanOptions& options) {
  return make_state<T>(operation, checked_problem(operation, input, output, options), options,
                       Purpose::size)
      ->strategy->workspace_bytes();
}

template <class T>
AttentionPlan<T> PlanAccess::make(const char* operation, const SdpaInput<T>& input,
                                  const UpstreamGradients<T>& upstream,
                                  const SdpaGradientOutput<T>& gradients,
                                  const SdpaBackwardOptions& options) {
  emflow::detail::SdpaBackwardForm form;
  const Problem p = checked_problem(operation, input, upstream, gradients, options, &form);
  return AttentionPlan<T>(make_state<T>(operation, p, PlanOptions{}, Purpose::run, form));
}

template <class T>
std::size_t PlanAccess::workspace_size(const char* operation, const SdpaInput<T>& input,
                                       const UpstreamGradients<T>& upstream,
                                       const SdpaGradientOutput<T>& gradients,
                                       const SdpaBackwardOptions& options) {
  emflow::detail::SdpaBackwardForm form;
  const Problem p = checked_problem(operation, input, upstream, gradients, options, &form);
  return make_state<T>(operation, p, PlanOptions{}, Purpose::size, form)
      ->strategy->workspace_bytes();
}

AttentionPlan<float> PlanAccess::decode(const char* operation,
                                        const emflow::detail::DecodeShape& shape) {
  emflow::detail::expect_positive(operation, "dim", shape.dim);
  emflow::detail::expect_positive(operation, "heads", shape.heads);
  emflow::detail::expect_positive(operation, "queries", shape.queries);
  Problem p;
  p.operation = Operation::decode;
  p.storage = Dtype::float32;
  p.tokens = shape.capacity;
  p.query_tokens = shape.queries;
  p.dim = shape.dim;
  p.heads = shape.heads;
  p.cross = true;
  auto state = std::make_unique<PlanState<float>>();
  state->operation = operation;
  state->problem = p;
  state->route = route_for(p, Purpose::run, operation);
  if (!state->route.supported) fail(ErrorCode::unsupported, state->route.reason);
  state->strategy = std::make_unique<emflow::detail::DecodeStrategy>(shape, operation);
  state->device = emflow::detail::current_device(operation);
  state->strategy->bind(state->device, true, operation);
  return AttentionPlan<float>(std::move(state));
}

void PlanAccess::run_decode(const AttentionPlan<float>& plan,
                            const emflow::detail::DecodeCall& call, void* workspace,
                            std::size_t workspace_bytes, cudaStream_t stream) {
  const PlanState<float>& s = state_of(plan.state_);
  const char* const op = s.operation.c_str();
  if (s.problem.operation != Operation::decode) {
    fail(ErrorCode::internal, op, ": run_decode on a plan that is not a decode cache's");
  }
  check_workspace(workspace, workspace_bytes, s.strategy->workspace_bytes(), op);
  emflow::detail::check_no_pending_error(op);
  const emflow::detail::DeviceGuard on_device(s.device, op);
  emflow::detail::expect_stream_of(op, stream, s.device);
  static_cast<const emflow::detail::DecodeStrategy&>(*s.strategy)
      .run_decode(call, static_cast<unsigned char*>(workspace), stream, op);
}

#define EMFLOW_PLAN_ACCESS(T)                                                                      \
  template AttentionPlan<T> PlanAccess::make<T>(const char*, const AttentionInput<T>&,             \
                                                const AttentionOutput<T>&, const PlanOptions&);    \
  template AttentionPlan<T> PlanAccess::make<T>(const char*, const AttentionInput<T>&,             \
                                                const FactoredLayer<T>&,                           \
                                                const AttentionOutput<T>&, const PlanOptions&);    \
  template AttentionPlan<T> PlanAccess::make<T>(const char*, const AttentionInput<T>&,             \
                                                const PartialOutput<T>&, const PlanOptions&);      \
  template std::size_t PlanAccess::workspace_size<T>(                                              \
      const char*, const AttentionInput<T>&, const AttentionOutput<T>&, const PlanOptions&);       \
  template std::size_t PlanAccess::workspace_size<T>(                                              \
      const char*, const AttentionInput<T>&, const FactoredLayer<T>&, const AttentionOutput<T>&,   \
      const PlanOptions&);                                                                         \
  template std::size_t PlanAccess::workspace_size<T>(const char*, const AttentionInput<T>&,        \
                                                     const PartialOutput<T>&, const PlanOptions&); \
  template AttentionPlan<T> PlanAccess::make<T>(const char*, const SdpaInput<T>&,                  \
                                                const SdpaOutput<T>&, const PlanOptions&);         \
  template std::size_t PlanAccess::workspace_size<T>(const char*, const SdpaInput<T>&,             \
                                                     const SdpaOutput<T>&, const PlanOptions&);    \
  template AttentionPlan<T> PlanAccess::make<T>(                                                   \
      const char*, const SdpaInput<T>&, const UpstreamGradients<T>&, const SdpaGradientOutput<T>&, \
      const SdpaBackwardOptions&);                                                                 \
  template std::size_t PlanAccess::workspace_size<T>(                                              \
      const char*, const SdpaInput<T>&, const UpstreamGradients<T>&, const SdpaGradientOutput<T>&, \
      const SdpaBackwardOptions&);
EMFLOW_PLAN_ACCESS(float)
EMFLOW_PLAN_ACCESS(double)
EMFLOW_PLAN_ACCESS(bfloat16)
EMFLOW_PLAN_ACCESS(float16)
#undef EMFLOW_PLAN_ACCESS

}  // namespace detail

}  // namespace emflow::cuda
