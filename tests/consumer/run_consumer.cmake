# cmake -P script behind the consumer.install_and_build test (see consumer_test.cmake).
cmake_minimum_required(VERSION 3.25)

function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "consumer test: ${what} failed (${status}):\n${out}")
  endif()
  message(STATUS "consumer test: ${what}: ok")
  set(last_output "${out}" PARENT_SCOPE)
endfunction()

set(work ${EMFLOW_CONSUMER_WORK})
set(prefix ${work}/prefix)
file(REMOVE_RECURSE ${work})

# The test may run after a partial build (`--target` something else): bring what is installed up
# to date first (a no-op after a full build).
set(config_args)
if(EMFLOW_CONSUMER_CONFIG)
  set(config_args --config ${EMFLOW_CONSUMER_CONFIG})
endif()
string(REPLACE "," ";" targets "${EMFLOW_CONSUMER_TARGETS}")  # a list cannot cross add_test
run("building ${targets}" ${CMAKE_COMMAND} --build ${EMFLOW_BINARY_DIR} --target ${targets}
    ${config_args})
run("cmake --install into ${prefix}" ${CMAKE_COMMAND} --install ${EMFLOW_BINARY_DIR}
    --prefix ${prefix} ${config_args})

# Configure with the same compiler (OpenMP flags and the C++ runtime must match) and find
# emflow only in the fresh prefix: no package registry, no system-wide copy shadowing it.
set(configure_args
    -S ${EMFLOW_CONSUMER_SOURCE} -B ${work}/build -G ${EMFLOW_CONSUMER_GENERATOR}
    -DCMAKE_CXX_COMPILER=${EMFLOW_CONSUMER_CXX}
    -DCMAKE_PREFIX_PATH=${prefix}
    -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
    -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF)
if(EMFLOW_CONSUMER_CONFIG)
  list(APPEND configure_args -DCMAKE_BUILD_TYPE=${EMFLOW_CONSUMER_CONFIG})
endif()
if(EMFLOW_CONSUMER_CUDA_ROOT)
  list(APPEND configure_args -DCUDAToolkit_ROOT=${EMFLOW_CONSUMER_CUDA_ROOT})
endif()
run("configuring the consumer" ${CMAKE_COMMAND} ${configure_args})

file(STRINGS ${work}/build/CMakeCache.txt found REGEX "^emflow_DIR:")
string(FIND "${found}" "${prefix}/" at)
if(NOT at GREATER -1)
  message(FATAL_ERROR "consumer test: emflow was found outside the install prefix: ${found}")
endif()

run("building the consumer" ${CMAKE_COMMAND} --build ${work}/build ${config_args})

set(program ${work}/build/emflow_example)
if(NOT EXISTS ${program} AND EMFLOW_CONSUMER_CONFIG)
  set(program ${work}/build/${EMFLOW_CONSUMER_CONFIG}/emflow_example)  # multi-config generators
endif()
run("running the consumer" ${program})
message(STATUS "${last_output}")
