// kvxfer C++ adapter: TensorRT-LLM's BaseTransferAgent shape on top of the
// kvxfer C ABI. Header-only, C++17. A serving stack can wrap
// KvxferTransferAgent in its own factory library.
//
// Thread safety: KvxferTransferAgent methods may be called from several
// threads at once (the C agent is thread-safe). A TransferStatus may be
// queried and waited on from several threads.
//
// Errors: calls that fail throw kvxfer::Error (code + message), except
// TransferStatus::wait, which reports kFAILURE and keeps the reason in
// TransferStatus::error().
#ifndef KVXFER_TRANSFER_AGENT_HPP
#define KVXFER_TRANSFER_AGENT_HPP

#include <kvxfer.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvxfer {

// ---- data model (TensorRT-LLM's transferAgent.h) ---------------------------

enum class MemoryType : uint32_t {
  kDRAM = KVXFER_MEM_DRAM,
  kVRAM = KVXFER_MEM_VRAM,
  kBLK = KVXFER_MEM_BLK,
  kOBJ = KVXFER_MEM_OBJ,
  kFILE = KVXFER_MEM_FILE,
};

class MemoryDesc {
 public:
  MemoryDesc(uintptr_t addr, size_t len, uint32_t deviceId)
      : mAddr(addr), mLen(len), mDeviceId(deviceId) {}
  MemoryDesc(void const* addr, size_t len, uint32_t deviceId)
      : MemoryDesc(reinterpret_cast<uintptr_t>(addr), len, deviceId) {}
  template <typename T>
  explicit MemoryDesc(std::vector<T> const& vec, uint32_t deviceId = 0)
      : MemoryDesc(vec.data(), vec.size() * sizeof(T), deviceId) {}

  uintptr_t getAddr() const noexcept { return mAddr; }
  size_t getLen() const noexcept { return mLen; }
  uint32_t getDeviceId() const noexcept { return mDeviceId; }

 private:
  uintptr_t mAddr;
  size_t mLen;
  uint32_t mDeviceId;
};

class MemoryDescs {
 public:
  MemoryDescs(MemoryType type, std::vector<MemoryDesc> descs)
      : mType(type), mDescs(std::move(descs)) {}
  MemoryType getType() const noexcept { return mType; }
  std::vector<MemoryDesc> const& getDescs() const noexcept { return mDescs; }

 private:
  MemoryType mType;
  std::vector<MemoryDesc> mDescs;
};

using TransferDescs = MemoryDescs;
using RegisterDescs = MemoryDescs;
using SyncMessage = std::string;
using ConnectionInfoType = std::string;

// The encoded kvxfer agent descriptor (opaque bytes).
class AgentDesc {
 public:
  explicit AgentDesc(std::string backendAgentDesc) : mDesc(std::move(backendAgentDesc)) {}
  std::string const& getBackendAgentDesc() const noexcept { return mDesc; }

 private:
  std::string mDesc;
};

enum class TransferOp : uint8_t { kREAD, kWRITE };

enum class TransferState : uint8_t { kIN_PROGRESS, kSUCCESS, kFAILURE };

// A transfer: `srcDescs` are local, `dstDescs` remote, whatever the
// direction (as in TensorRT-LLM): kWRITE copies src -> dst, kREAD dst -> src.
class TransferRequest {
 public:
  TransferRequest(TransferOp op, TransferDescs srcDescs, TransferDescs dstDescs,
                  std::string const& remoteName,
                  std::optional<SyncMessage> syncMessage = std::nullopt)
      : mOp(op),
        mSrcDescs(std::move(srcDescs)),
        mDstDescs(std::move(dstDescs)),
        mRemoteName(remoteName),
        mSyncMessage(std::move(syncMessage)) {}

  TransferOp getOp() const noexcept { return mOp; }
  TransferDescs const& getSrcDescs() const noexcept { return mSrcDescs; }
  TransferDescs const& getDstDescs() const noexcept { return mDstDescs; }
  std::string const& getRemoteName() const noexcept { return mRemoteName; }
  std::optional<SyncMessage> const& getSyncMessage() const noexcept { return mSyncMessage; }

 private:
  TransferOp mOp;
  TransferDescs mSrcDescs;
  TransferDescs mDstDescs;
  std::string mRemoteName;
  std::optional<SyncMessage> mSyncMessage;
};

class TransferStatus {
 public:
  virtual ~TransferStatus() = default;
  [[nodiscard]] virtual bool isCompleted() const = 0;
  // Waits up to timeout_ms (negative: until the transfer ends, which the
  // agent's I/O timeout bounds).
  [[nodiscard]] virtual TransferState wait(int64_t timeout_ms = -1) const = 0;
};

struct BaseAgentConfig {
  std::string mName;
  bool mUseProgThread = true;  // kvxfer always progresses on its own threads.
  std::string mBackend = "auto";  // "auto", "tcp", "shm".
  std::string mListen;            // "host:port"; empty: 127.0.0.1:0.
};

class BaseTransferAgent {
 public:
  virtual ~BaseTransferAgent() = default;
  virtual void registerMemory(RegisterDescs const& descs) = 0;
  virtual void deregisterMemory(RegisterDescs const& descs) = 0;
  virtual void loadRemoteAgent(std::string const& name, AgentDesc const& agentDesc) = 0;
  virtual void loadRemoteAgent(std::string const& name, ConnectionInfoType const& connectionInfo) = 0;
  virtual AgentDesc getLocalAgentDesc() = 0;
  virtual void invalidateRemoteAgent(std::string const& name) = 0;
  [[nodiscard]] virtual std::unique_ptr<TransferStatus> submitTransferRequests(TransferRequest const& request) = 0;
  virtual void notifySyncMessage(std::string const& name, SyncMessage const& syncMessage) = 0;
  virtual std::unordered_map<std::string, std::vector<SyncMessage>> getNotifiedSyncMessages() = 0;
  virtual ConnectionInfoType getLocalConnectionInfo() = 0;
  virtual bool checkRemoteDescs(std::string const& name, MemoryDescs const& memoryDescs) = 0;
};

// ---- the kvxfer implementation ----------------------------------------------

class Error : public std::runtime_error {
 public:
  Error(kvxfer_result code, std::string const& what) : std::runtime_error(what), mCode(code) {}
  kvxfer_result code() const noexcept { return mCode; }

 private:
  kvxfer_result mCode;
};

namespace detail {

inline std::string lastError() {
  size_t n = kvxfer_last_error(nullptr, 0);
  std::string s(n + 1, '\0');
  kvxfer_last_error(s.data(), s.size());
  s.resize(n);
  return s;
}

inline void check(kvxfer_result r, char const* call) {
  if (r != KVXFER_OK) {
    throw Error(r, std::string(call) + ": " + kvxfer_result_name(r) + ": " + lastError());
  }
}

inline std::vector<kvxfer_mem_desc> toC(MemoryDescs const& d) {
  std::vector<kvxfer_mem_desc> out;
  out.reserve(d.getDescs().size());
  for (auto const& m : d.getDescs()) {
    out.push_back(kvxfer_mem_desc{static_cast<uint64_t>(m.getAddr()), static_cast<uint64_t>(m.getLen()),
                                  m.getDeviceId()});
  }
  return out;
}

}  // namespace detail

class KvxferTransferStatus final : public TransferStatus {
 public:
  explicit KvxferTransferStatus(kvxfer_status* s) : mStatus(s) {}
  ~KvxferTransferStatus() override { kvxfer_status_free(mStatus); }
  KvxferTransferStatus(KvxferTransferStatus const&) = delete;
  KvxferTransferStatus& operator=(KvxferTransferStatus const&) = delete;

  [[nodiscard]] bool isCompleted() const override {
    bool done = false;
    detail::check(kvxfer_status_is_completed(mStatus, &done), "kvxfer_status_is_completed");
    return done;
  }

  [[nodiscard]] TransferState wait(int64_t timeout_ms = -1) const override {
    kvxfer_result r = kvxfer_status_wait(mStatus, timeout_ms);
    if (r == KVXFER_OK) return TransferState::kSUCCESS;
    if (r == KVXFER_IN_PROGRESS) return TransferState::kIN_PROGRESS;
    mCode = r;
    mError = std::string(kvxfer_result_name(r)) + ": " + detail::lastError();
    return TransferState::kFAILURE;
  }

  // kvxfer extension: asks for the transfer to be aborted (see
  // kvxfer_status_abort); true when it was still running. wait() then
  // reports kFAILURE with errorCode() KVXFER_ERR_ABORTED once nothing of
  // the transfer moves any more (or kSUCCESS, when all of it had been
  // sent before the abort).
  bool abort() const {
    bool running = false;
    detail::check(kvxfer_status_abort(mStatus, &running), "kvxfer_status_abort");
    return running;
  }

  // Why the last wait() reported kFAILURE.
  std::string const& error() const noexcept { return mError; }
  // Its code (KVXFER_OK before any failure).
  kvxfer_result errorCode() const noexcept { return mCode; }

 private:
  kvxfer_status* mStatus;
  mutable std::string mError;
  mutable kvxfer_result mCode = KVXFER_OK;
};

class KvxferTransferAgent final : public BaseTransferAgent {
 public:
  explicit KvxferTransferAgent(BaseAgentConfig const& config) {
    kvxfer_options opts{};
    opts.struct_size = sizeof opts;
    opts.listen = config.mListen.empty() ? nullptr : config.mListen.c_str();
    detail::check(kvxfer_agent_new(config.mName.c_str(), config.mBackend.c_str(), &opts, &mAgent),
                  "kvxfer_agent_new");
  }
  ~KvxferTransferAgent() override { kvxfer_agent_free(mAgent); }
  KvxferTransferAgent(KvxferTransferAgent const&) = delete;
  KvxferTransferAgent& operator=(KvxferTransferAgent const&) = delete;

  void registerMemory(RegisterDescs const& descs) override {
    auto d = detail::toC(descs);
    detail::check(kvxfer_agent_register_memory(mAgent, static_cast<kvxfer_mem_type>(descs.getType()), d.data(),
                                               d.size()),
                  "kvxfer_agent_register_memory");
  }

  void deregisterMemory(RegisterDescs const& descs) override {
    auto d = detail::toC(descs);
    detail::check(kvxfer_agent_deregister_memory(mAgent, static_cast<kvxfer_mem_type>(descs.getType()), d.data(),
                                                 d.size()),
                  "kvxfer_agent_deregister_memory");
  }

  // The descriptor's name is checked before anything is loaded: a
  // descriptor for another agent throws and leaves every loaded peer as it
  // was.
  void loadRemoteAgent(std::string const& name, AgentDesc const& agentDesc) override {
    auto const& bytes = agentDesc.getBackendAgentDesc();
    auto const* data = reinterpret_cast<uint8_t const*>(bytes.data());
    std::string carried(256 + 1, '\0');
    size_t len = 0;
    detail::check(kvxfer_desc_name(data, bytes.size(), carried.data(), carried.size(), &len), "kvxfer_desc_name");
    carried.resize(len);
    if (carried != name) {
      throw Error(KVXFER_ERR_INVALID_AGENT_DESC, "descriptor is for agent \"" + carried + "\", not \"" + name + "\"");
    }
    detail::check(kvxfer_agent_load_remote(mAgent, data, bytes.size(), nullptr, 0, nullptr),
                  "kvxfer_agent_load_remote");
  }

  void loadRemoteAgent(std::string const& name, ConnectionInfoType const& connectionInfo) override {
    size_t len = 0;
    kvxfer_result r = kvxfer_agent_fetch_remote_desc(mAgent, connectionInfo.c_str(), nullptr, 0, &len);
    if (r != KVXFER_ERR_BUFFER_TOO_SMALL) {
      detail::check(r, "kvxfer_agent_fetch_remote_desc");
    }
    std::string bytes(len, '\0');
    detail::check(kvxfer_agent_fetch_remote_desc(mAgent, connectionInfo.c_str(), reinterpret_cast<uint8_t*>(bytes.data()),
                                                 bytes.size(), &len),
                  "kvxfer_agent_fetch_remote_desc");
    bytes.resize(len);
    try {
      loadRemoteAgent(name, AgentDesc(std::move(bytes)));
    } catch (Error const& e) {
      if (e.code() != KVXFER_ERR_INVALID_AGENT_DESC) throw;
      throw Error(e.code(), "agent at " + connectionInfo + ": " + e.what());
    }
  }

  AgentDesc getLocalAgentDesc() override {
    size_t len = 0;
    kvxfer_agent_local_desc(mAgent, nullptr, 0, &len);
    std::string bytes(len, '\0');
    detail::check(kvxfer_agent_local_desc(mAgent, reinterpret_cast<uint8_t*>(bytes.data()), bytes.size(), &len),
                  "kvxfer_agent_local_desc");
    bytes.resize(len);
    return AgentDesc(std::move(bytes));
  }

  void invalidateRemoteAgent(std::string const& name) override {
    detail::check(kvxfer_agent_invalidate_remote(mAgent, name.c_str()), "kvxfer_agent_invalidate_remote");
  }

  [[nodiscard]] std::unique_ptr<TransferStatus> submitTransferRequests(TransferRequest const& request) override {
    auto local = detail::toC(request.getSrcDescs());
    auto remote = detail::toC(request.getDstDescs());
    kvxfer_request r{};
    r.op = request.getOp() == TransferOp::kWRITE ? KVXFER_OP_WRITE : KVXFER_OP_READ;
    r.local_type = static_cast<kvxfer_mem_type>(request.getSrcDescs().getType());
    r.local = local.data();
    r.local_count = local.size();
    r.remote_type = static_cast<kvxfer_mem_type>(request.getDstDescs().getType());
    r.remote = remote.data();
    r.remote_count = remote.size();
    r.remote_agent = request.getRemoteName().c_str();
    auto const& sync = request.getSyncMessage();
    if (sync) {
      r.sync_message = reinterpret_cast<uint8_t const*>(sync->data());
      r.sync_message_len = sync->size();
    }
    kvxfer_status* st = nullptr;
    detail::check(kvxfer_agent_submit(mAgent, &r, &st), "kvxfer_agent_submit");
    return std::make_unique<KvxferTransferStatus>(st);
  }

  // Fire and forget, ordered after the data of earlier transfers to `name`.
  void notifySyncMessage(std::string const& name, SyncMessage const& syncMessage) override {
    detail::check(kvxfer_agent_notify(mAgent, name.c_str(), reinterpret_cast<uint8_t const*>(syncMessage.data()),
                                      syncMessage.size(), nullptr),
                  "kvxfer_agent_notify");
  }

  std::unordered_map<std::string, std::vector<SyncMessage>> getNotifiedSyncMessages() override {
    kvxfer_messages* m = nullptr;
    detail::check(kvxfer_agent_take_messages(mAgent, &m), "kvxfer_agent_take_messages");
    std::unordered_map<std::string, std::vector<SyncMessage>> out;
    size_t n = 0;
    kvxfer_messages_count(m, &n);
    for (size_t i = 0; i < n; ++i) {
      char const* from = nullptr;
      uint8_t const* data = nullptr;
      size_t len = 0;
      if (kvxfer_messages_get(m, i, &from, &data, &len) == KVXFER_OK) {
        out[from].emplace_back(reinterpret_cast<char const*>(data), len);
      }
    }
    kvxfer_messages_free(m);
    return out;
  }

  ConnectionInfoType getLocalConnectionInfo() override {
    size_t len = 0;
    kvxfer_agent_connection_info(mAgent, nullptr, 0, &len);
    std::string s(len + 1, '\0');
    detail::check(kvxfer_agent_connection_info(mAgent, s.data(), s.size(), &len), "kvxfer_agent_connection_info");
    s.resize(len);
    return s;
  }

  bool checkRemoteDescs(std::string const& name, MemoryDescs const& memoryDescs) override {
    auto d = detail::toC(memoryDescs);
    bool ok = false;
    detail::check(kvxfer_agent_check_remote_descs(mAgent, name.c_str(), static_cast<kvxfer_mem_type>(memoryDescs.getType()),
                                                  d.data(), d.size(), &ok),
                  "kvxfer_agent_check_remote_descs");
    return ok;
  }

  // The underlying C handle, for calls the adapter does not wrap.
  kvxfer_agent* handle() const noexcept { return mAgent; }

 private:
  kvxfer_agent* mAgent = nullptr;
};

// Factory in TensorRT-LLM's style: `backend` is "auto", "tcp" or "shm".
inline std::unique_ptr<BaseTransferAgent> makeTransferAgent(std::string const& backend, BaseAgentConfig config) {
  config.mBackend = backend;
  return std::make_unique<KvxferTransferAgent>(config);
}

}  // namespace kvxfer

#endif  // KVXFER_TRANSFER_AGENT_HPP
