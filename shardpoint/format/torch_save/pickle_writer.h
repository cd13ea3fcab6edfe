// PickleWriter: emits protocol-2 pickles the way CPython's C pickler does.
//
// Protocol 2 is what torch.save writes (`torch.serialization.DEFAULT_PROTOCOL`) and the only one
// `torch.load(weights_only=True)` reads without a warning; its restricted unpickler knows no
// protocol-4 opcodes (FRAME, MEMOIZE, SHORT_BINUNICODE, STACK_GLOBAL). Plain `pickle.load`, which
// torch 2.13's FileSystemReader uses for `.metadata`, reads every protocol. So everything
// shardpoint writes for PyTorch is protocol 2.
//
// The writer memoizes like CPython (BINPUT after every str, non-empty tuple, list, dict, global
// and REDUCE / NEWOBJ result; BINGET when the same global, or with `dedupe_strings` the same str,
// is written again), so a torch.save data.pkl written here is byte-identical to torch's. The
// caller drives the stack machine: push values, then the opcode that consumes them. Not
// thread-safe; one writer per pickle.
#ifndef SHARDPOINT_FORMAT_TORCH_SAVE_PICKLE_WRITER_H_
#define SHARDPOINT_FORMAT_TORCH_SAVE_PICKLE_WRITER_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <utility>

namespace sp::torch_save {

class PickleWriter {
 public:
  // `dedupe_strings`: a str equal to one written before is emitted as BINGET (CPython does this
  // only for the same object; either way the unpickled value is equal).
  explicit PickleWriter(bool dedupe_strings = false);

  void None();
  void Bool(bool v);
  // BININT1 / BININT2 / BININT when it fits, else LONG1 with the fewest bytes.
  void Int(int64_t v);
  void Float(double v);  // BINFLOAT
  // BINUNICODE (the caller passes UTF-8), then BINPUT.
  void String(std::string_view utf8);
  // Protocol 2 has no bytes opcode: `_codecs.encode(latin1_text, 'latin1')`, or `bytes()` when
  // empty, exactly as CPython writes it.
  void Bytes(std::string_view data);
  // GLOBAL module\nname\n then BINPUT; BINGET when written before. Python 3 names with a Python 2
  // spelling (builtins -> __builtin__, copyreg -> copy_reg) are written in the Python 2 spelling.
  void Global(std::string_view module, std::string_view name);

  void Mark();
  // Closes a tuple of the last `n` values: EMPTY_TUPLE, TUPLE1..TUPLE3, or (after a Mark() that
  // the caller wrote before the items when TupleNeedsMark(n)) TUPLE; then BINPUT unless empty.
  void Tuple(size_t n);
  static bool TupleNeedsMark(size_t n) { return n > 3; }
  void EmptyList();  // then BINPUT
  void EmptyDict();  // then BINPUT

  // The items of the list or dict on top of the stack, batched like CPython: `write_item(i)`
  // pushes item i (for dicts: key then value). One item -> APPEND / SETITEM; otherwise batches
  // of 1000 in MARK ... APPENDS / SETITEMS.
  void ListItems(size_t n, const std::function<void(size_t)>& write_item);
  void DictItems(size_t n, const std::function<void(size_t)>& write_pair);

  void Reduce();     // REDUCE then BINPUT
  void NewObj();     // NEWOBJ then BINPUT
  void Build();      // BUILD
  void BinPersId();  // BINPERSID
  void SetItem();    // SETITEM
  void SetItems();   // SETITEMS

  // Writes STOP and returns the pickle. The writer must not be used afterwards.
  std::string Finish();

 private:
  void Memoize();
  // Pushes memo entry `index` again (BINGET, or LONG_BINGET past 255).
  void MemoGet(uint32_t index);
  void Op(uint8_t op) { out_.push_back(static_cast<char>(op)); }
  void U32(uint32_t v);

  std::string out_;
  bool dedupe_strings_;
  uint32_t next_memo_ = 0;
  std::map<std::pair<std::string, std::string>, uint32_t> globals_;
  std::map<std::string, uint32_t, std::less<>> strings_;
};

}  // namespace sp::torch_save

#endif  // SHARDPOINT_FORMAT_TORCH_SAVE_PICKLE_WRITER_H_
