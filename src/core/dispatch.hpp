// What the host entry points (attend, attend_factored, attend_partial, the decode cache) share
// between their validation and their backend: the part of the Problem that reads arrays, and the
// record of the route they took.
//
// Each entry point validates (validate.hpp), describes its call (emflow::describe), sets
// Problem::finite from inputs_finite, asks require_route (capability.hpp) and then calls the
// backend the route names, and nothing else: the routing rules live in src/core/capability.cpp
// alone.
#pragma once

#include <cstdint>

#include "emflow/attention.hpp"
#include "emflow/capability.hpp"
#include "emflow/factored.hpp"

namespace emflow::detail {

/// Problem::finite of an attend or attend_partial call on validated input: every key (the
/// cloud's tokens within the key lengths) is finite; for the 16-bit types every value of the
/// cloud, the queries and the operators (src/core/finite.cpp says why).
template <class T>
bool inputs_finite(const AttentionInput<T>& input);
/// The same for attend_factored: the cloud, the queries and the factors (A, B, U, V, u, c).
template <class T>
bool inputs_finite(const AttentionInput<T>& input, const FactoredLayer<T>& layer);

/// True when the `count` values at `values` (none when null) are all finite (float and double,
/// src/core/finite.cpp): the exponent field of none is all ones.
template <class T>
bool all_finite(const T* values, std::int64_t count);

/// The route that the last require_route() of this thread answered (supported or not): the
/// test hook with which tests check that an entry point ran where route() says
/// (tests/core/entry_routes_test.cpp). Empty (unsupported, no reason) before the first call.
const Route& last_route() noexcept;

}  // namespace emflow::detail
