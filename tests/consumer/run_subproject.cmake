# cmake -P script behind the consumer.subproject test (see consumer_test.cmake): configures
# tests/consumer/subproject, which adds this source tree with add_subdirectory, builds and runs its
# program, and checks the compile lines: emflow's warning flags and CPU path definitions stay on
# emflow's own files and never reach the consumer's. The consumer gives no build type (so emflow's code is
# compiled without optimisation, the cheapest build that links) and builds without CUDA and with
# the CPU engine's host path alone (a third of src/cpu's compilation): what is checked here is the
# configuration and the flags, which the CUDA build and every path share.
cmake_minimum_required(VERSION 3.25)

function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "consumer subproject test: ${what} failed (${status}):\n${out}")
  endif()
  message(STATUS "consumer subproject test: ${what}: ok")
  set(last_output "${out}" PARENT_SCOPE)
endfunction()

set(work ${EMFLOW_CONSUMER_WORK})
file(REMOVE_RECURSE ${work})
run("configuring the consumer" ${CMAKE_COMMAND}
    -S ${EMFLOW_CONSUMER_SOURCE}/subproject -B ${work} -G ${EMFLOW_CONSUMER_GENERATOR}
    -DCMAKE_CXX_COMPILER=${EMFLOW_CONSUMER_CXX}
    -DEMFLOW_SOURCE_DIR=${EMFLOW_SOURCE_DIR}
    -DEMFLOW_WITH_CUDA=OFF
    -DEMFLOW_ONLY_CPU_PATH=host
    -DCMAKE_EXPORT_COMPILE_COMMANDS=ON)
run("building the consumer" ${CMAKE_COMMAND} --build ${work} --target emflow_example)
run("running the consumer" ${work}/emflow_example)
message(STATUS "${last_output}")

# The compile lines: the consumer's file, and one of emflow's CPU backend as the control (it must
# carry both, or the check below would prove nothing).
file(READ ${work}/compile_commands.json commands)
string(JSON count LENGTH "${commands}")
math(EXPR last "${count} - 1")
set(consumer_line)
set(emflow_line)
foreach(i RANGE ${last})
  string(JSON file GET "${commands}" ${i} file)
  string(JSON line GET "${commands}" ${i} command)
  if(file MATCHES "/tests/consumer/example\\.cpp$")
    set(consumer_line "${line}")
  elseif(file MATCHES "/src/cpu/engine\\.cpp$")
    set(emflow_line "${line}")
  endif()
endforeach()
if(NOT consumer_line OR NOT emflow_line)
  message(FATAL_ERROR "consumer subproject test: compile_commands.json lacks example.cpp or "
                      "src/cpu/engine.cpp")
endif()
set(flags -Wall -Wextra -Wpedantic -DEMFLOW_CPU_LEVEL=)
foreach(flag IN LISTS flags)
  string(FIND "${emflow_line}" " ${flag}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "consumer subproject test: emflow's own src/cpu/engine.cpp is compiled "
                        "without ${flag}, so its absence below would prove nothing:\n${emflow_line}")
  endif()
endforeach()
list(APPEND flags -Werror -Wno-psabi -fopenmp)
foreach(flag IN LISTS flags)
  string(FIND "${consumer_line}" " ${flag}" at)
  if(NOT at EQUAL -1)
    message(FATAL_ERROR "consumer subproject test: emflow's ${flag} reached the consumer's "
                        "example.cpp:\n${consumer_line}")
  endif()
endforeach()
# The consumer sees the public headers only, not emflow's src/.
if(consumer_line MATCHES "-I[^ ]*/src( |$)")
  message(FATAL_ERROR "consumer subproject test: emflow's src/ is on the consumer's include "
                      "path:\n${consumer_line}")
endif()
message(STATUS "consumer subproject test: no warning flag, CPU path definition or private include "
               "folder of emflow's on the consumer's compile line")
