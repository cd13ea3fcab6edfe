// Small helpers shared by the pickle reader and writer. Internal to shardpoint/format/torch_dcp.
#ifndef SHARDPOINT_FORMAT_TORCH_SAVE_PICKLE_UTIL_H_
#define SHARDPOINT_FORMAT_TORCH_SAVE_PICKLE_UTIL_H_

#include <string>
#include <string_view>

namespace sp::torch_save {

// True when `s` is UTF-8 as Python decodes pickled str ('surrogatepass': encoded surrogates
// are accepted; overlong forms, truncated sequences and code points above U+10FFFF are not).
bool IsPythonUtf8(std::string_view s);

// Maps the Python 2 module names that protocol-2 pickles carry to Python 3's
// (`__builtin__` -> `builtins`, `copy_reg` -> `copyreg`), as Python's unpickler does.
void MapPython2Module(std::string* module);

}  // namespace sp::torch_save

#endif  // SHARDPOINT_FORMAT_TORCH_SAVE_PICKLE_UTIL_H_
