# cmake -P script behind the consumer.distributed test (consumer_test.cmake): the install and the
# build of run_consumer.cmake for this folder's project (a scratch folder of its own, the
# distributed library installed too), which runs emflow_example; then the program built against
# src/distributed from its sources.
cmake_minimum_required(VERSION 3.25)
set(EMFLOW_CONSUMER_SOURCE ${CMAKE_CURRENT_LIST_DIR})
set(EMFLOW_CONSUMER_WORK ${EMFLOW_CONSUMER_WORK}_distributed)
set(EMFLOW_CONSUMER_TARGETS "${EMFLOW_CONSUMER_TARGETS},emflow_distributed")
include(${CMAKE_CURRENT_LIST_DIR}/../run_consumer.cmake)

set(program ${work}/build/emflow_example_from_source)
if(NOT EXISTS ${program} AND EMFLOW_CONSUMER_CONFIG)
  set(program ${work}/build/${EMFLOW_CONSUMER_CONFIG}/emflow_example_from_source)
endif()
run("running the program over src/distributed built from its sources" ${program})
message(STATUS "${last_output}")
