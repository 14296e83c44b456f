// What every attention test compares against: the composed double-precision reference
// (reference::attend, include/emflow/reference.hpp) of a Problem, and the check that a
// backend's outputs match it.
#pragma once

#include <string>

#include "common/testing.hpp"
#include "emflow/reference.hpp"

namespace emflow::testing {

/// reference::attend on the problem's arrays (the double values the float buffers round to).
reference::Attention composed_reference(const Problem& problem, bool with_weights);

/// Every output the backend wrote agrees with `want` to `tolerance` (relative error), none is
/// NaN (they were poisoned), a query that sees no key has exactly delta = 0, lse = -inf and
/// entropy = 0, and a weight the mask hides is exactly 0. Fails (without aborting) naming `what`.
/// `want` must not be all zeros: the comparison would be vacuous.
template <class T>
void expect_matches(const Buffers<T>& got, const reference::Attention& want, double tolerance,
                    const std::string& what);

}  // namespace emflow::testing
