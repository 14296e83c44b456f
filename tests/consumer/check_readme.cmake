# cmake -P script behind the consumer.readme_example test: README.md must contain
# tests/consumer/example.cpp verbatim, so the README's C++ example is compiled and run by the
# consumer test.
file(READ ${EMFLOW_README} readme)
file(READ ${EMFLOW_EXAMPLE} example)
string(FIND "${readme}" "```cpp\n${example}```" at)
if(at EQUAL -1)
  message(FATAL_ERROR "README.md does not show ${EMFLOW_EXAMPLE} verbatim in a ```cpp block; "
                      "copy the file into the README's C++ example")
endif()
