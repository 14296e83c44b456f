# Included by tests/CMakeLists.txt. Two tests:
#   consumer.install_and_build: `cmake --install` this build into a scratch prefix, then configure,
#     build and run tests/consumer (find_package(emflow), emflow::emflow) against that prefix only;
#   consumer.readme_example: the README shows tests/consumer/example.cpp verbatim, so the C++
#     example in the README is the code this suite compiles and runs.
set(_emflow_consumer_args
    -DEMFLOW_BINARY_DIR=${PROJECT_BINARY_DIR}
    -DEMFLOW_CONSUMER_SOURCE=${CMAKE_CURRENT_LIST_DIR}
    -DEMFLOW_CONSUMER_WORK=${CMAKE_CURRENT_BINARY_DIR}/consumer
    -DEMFLOW_CONSUMER_CONFIG=$<CONFIG>
    -DEMFLOW_CONSUMER_GENERATOR=${CMAKE_GENERATOR}
    -DEMFLOW_CONSUMER_CXX=${CMAKE_CXX_COMPILER}
    -DEMFLOW_CONSUMER_TARGETS=emflow$<$<TARGET_EXISTS:emflow_cli>:,emflow_cli>)
# A CUDA build's package config looks for the CUDA toolkit: point the consumer at the same one.
if(EMFLOW_WITH_CUDA AND CUDAToolkit_BIN_DIR)
  get_filename_component(_emflow_cuda_root "${CUDAToolkit_BIN_DIR}" DIRECTORY)
  list(APPEND _emflow_consumer_args -DEMFLOW_CONSUMER_CUDA_ROOT=${_emflow_cuda_root})
endif()
add_test(NAME consumer.install_and_build
         COMMAND ${CMAKE_COMMAND} ${_emflow_consumer_args}
                 -P ${CMAKE_CURRENT_LIST_DIR}/run_consumer.cmake)
set_tests_properties(consumer.install_and_build PROPERTIES LABELS consumer TIMEOUT 900)

add_test(NAME consumer.readme_example
         COMMAND ${CMAKE_COMMAND} -DEMFLOW_README=${PROJECT_SOURCE_DIR}/README.md
                 -DEMFLOW_EXAMPLE=${CMAKE_CURRENT_LIST_DIR}/example.cpp
                 -P ${CMAKE_CURRENT_LIST_DIR}/check_readme.cmake)
set_tests_properties(consumer.readme_example PROPERTIES LABELS consumer)

# consumer.distributed (tests/consumer/distributed): the same install, then a program against the
# installed emflow::distributed, and src/distributed built from its sources against the installed
# emflow alone. After install_and_build, which builds and installs from the same tree.
add_test(NAME consumer.distributed
         COMMAND ${CMAKE_COMMAND} ${_emflow_consumer_args}
                 -P ${CMAKE_CURRENT_LIST_DIR}/distributed/run.cmake)
set_tests_properties(consumer.distributed PROPERTIES LABELS consumer TIMEOUT 900
                     DEPENDS consumer.install_and_build)
# consumer.subproject: a project that adds this source tree with add_subdirectory (no install),
# with the tool's and the tests' dependencies disabled, builds and runs the same example, and its
# compile line carries none of emflow's warning flags or -march=native (run_subproject.cmake).
add_test(NAME consumer.subproject
         COMMAND ${CMAKE_COMMAND} -DEMFLOW_SOURCE_DIR=${PROJECT_SOURCE_DIR}
                 -DEMFLOW_CONSUMER_SOURCE=${CMAKE_CURRENT_LIST_DIR}
                 -DEMFLOW_CONSUMER_WORK=${CMAKE_CURRENT_BINARY_DIR}/consumer_subproject
                 -DEMFLOW_CONSUMER_GENERATOR=${CMAKE_GENERATOR}
                 -DEMFLOW_CONSUMER_CXX=${CMAKE_CXX_COMPILER}
                 -P ${CMAKE_CURRENT_LIST_DIR}/run_subproject.cmake)
set_tests_properties(consumer.subproject PROPERTIES LABELS consumer TIMEOUT 900)
