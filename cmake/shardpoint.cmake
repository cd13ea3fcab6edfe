# sp_library(NAME SRCS a.cc b.cc DEPS other_lib ...)
function(sp_library name)
  cmake_parse_arguments(A "" "" "SRCS;DEPS" ${ARGN})
  add_library(${name} STATIC ${A_SRCS})
  target_include_directories(${name} PUBLIC ${PROJECT_SOURCE_DIR})
  target_link_libraries(${name} PUBLIC ${A_DEPS} Threads::Threads)
endfunction()

# sp_test(NAME [WHOLE] SRCS a_test.cc DEPS lib ...): one GoogleTest binary, each case registered
# with ctest, or with WHOLE the binary as one ctest test: for suites whose cases share something
# costly to set up once per process (an S3 server), which one process per case would set up again
# for every case.
function(sp_test name)
  if(NOT SP_BUILD_TESTS)
    return()
  endif()
  cmake_parse_arguments(A "WHOLE" "" "SRCS;DEPS" ${ARGN})
  add_executable(${name} ${A_SRCS})
  # The suites' own code (GoogleTest's templates, mostly) is compiled at -O1 without debug
  # information outside Debug builds: that halves their compile time, most of a build's. The code
  # under test is in the libraries, compiled with the build type's flags.
  target_compile_options(${name} PRIVATE "$<$<NOT:$<CONFIG:Debug>>:-O1;-g0>")
  target_link_libraries(${name} PRIVATE ${A_DEPS} GTest::gtest GTest::gmock GTest::gtest_main)
  if(A_WHOLE)
    add_test(NAME ${name} COMMAND ${name})
    set_tests_properties(${name} PROPERTIES TIMEOUT 900)
  else()
    gtest_discover_tests(${name} DISCOVERY_TIMEOUT 120 PROPERTIES TIMEOUT 900)
  endif()
endfunction()
