# Included by tests/CMakeLists.txt: the documentation tests (label docs), cmake -P scripts that
# read the pages and the tree and build nothing (check_docs.cmake says what each checks).
#   docs.architecture  every public header and every file of src/ and kernels/ is named in
#                      docs/ARCHITECTURE.md
#   docs.math_table    the files and functions of docs/MATH.md's "Where each formula lives in the
#                      code" exist
#   docs.links         the relative links of README.md and docs/*.md point at files that exist
foreach(_emflow_check architecture math_table links)
  add_test(NAME docs.${_emflow_check}
           COMMAND ${CMAKE_COMMAND} -DROOT=${PROJECT_SOURCE_DIR} -DCHECK=${_emflow_check}
                   -P ${CMAKE_CURRENT_LIST_DIR}/check_docs.cmake)
  set_tests_properties(docs.${_emflow_check} PROPERTIES LABELS docs)
endforeach()
