# gpuipc_embed_file(<target-source-var> <input> <symbol>): turns a binary file into a C++ source defining
#   extern const unsigned char <symbol>[]; extern const std::size_t <symbol>_size;
function(gpuipc_embed_file out_var input symbol)
  set(out "${CMAKE_CURRENT_BINARY_DIR}/${symbol}.cpp")
  add_custom_command(
    OUTPUT "${out}"
    COMMAND ${CMAKE_COMMAND} -DINPUT=${input} -DOUTPUT=${out} -DSYMBOL=${symbol} -P ${PROJECT_SOURCE_DIR}/cmake/embed_run.cmake
    DEPENDS "${input}" ${PROJECT_SOURCE_DIR}/cmake/embed_run.cmake
    COMMENT "Embedding ${symbol}")
  set(${out_var} "${out}" PARENT_SCOPE)
endfunction()
