// What the OpenAI API's two halves share (openai_api.cc reads requests, openai_responses.cc
// writes answers): the JSON type and the one way this API serializes it.
#ifndef SUBSPACE_SERVER_OPENAI_JSON_H_
#define SUBSPACE_SERVER_OPENAI_JSON_H_

#include <string>

#include "nlohmann/json.hpp"

namespace subspace::server::openai {

using Json = nlohmann::json;

// Compact JSON with invalid UTF-8 replaced, so no string from a client or the model can make a
// body fail to serialize.
inline std::string Dump(const Json& j) {
  return j.dump(-1, ' ', false, Json::error_handler_t::replace);
}

}  // namespace subspace::server::openai

#endif  // SUBSPACE_SERVER_OPENAI_JSON_H_
