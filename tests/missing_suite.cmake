# The test that stands for a suite the configuration should have registered and did not (ctest
# -P): it fails with the reason, so a missing suite is a failing test, never a silent gap.
# Usage: cmake -DSUITE=<name> -DREASON=<text> -P missing_suite.cmake
message(FATAL_ERROR "the ${SUITE} suite is not registered: ${REASON}")
