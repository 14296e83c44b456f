# The warning flags of every target built from this tree (the library, the distributed library,
# the tool, the tests, the benchmarks, the fuzzers and the Python module), written once here.
# PRIVATE: they never reach a consumer's targets, whether emflow is installed or added with
# add_subdirectory. C++ only: nvcc has flags of its own, and device code is compiled with none.
#
#   emflow_warnings(<target>...)
function(emflow_warnings)
  set(flags -Wall -Wextra -Wpedantic)
  if(EMFLOW_WARNINGS_AS_ERRORS)
    list(APPEND flags -Werror)
  endif()
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    # GCC notes that passing 64-byte vectors by value changed ABI in GCC 4.6; every caller is
    # ours, compiled by the same compiler.
    list(APPEND flags -Wno-psabi)
  endif()
  foreach(target IN LISTS ARGN)
    target_compile_options(${target} PRIVATE "$<$<COMPILE_LANGUAGE:CXX>:${flags}>")
  endforeach()
endfunction()
