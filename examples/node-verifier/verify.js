// The verifier's rule, apart from gRPC: exact (or numeric) match of the completion against the
// ground truth, with partial credit for the characters that match position by position.
"use strict";

/** A request the verifier refuses; the server answers it with INVALID_ARGUMENT and this message. */
class InvalidItem extends Error {}

function parseMetadata(item, index) {
  let metadata;
  try {
    metadata = JSON.parse(item.metadataJson);
  } catch (error) {
    throw new InvalidItem(`items[${index}] (sample ${item.sampleId}): metadata_json is not valid JSON: ${error.message}`);
  }
  if (metadata === null || typeof metadata !== "object" || Array.isArray(metadata)) {
    throw new InvalidItem(`items[${index}] (sample ${item.sampleId}): metadata_json must be a JSON object, got ${item.metadataJson}`);
  }
  if (!["string", "number"].includes(typeof metadata.answer)) {
    throw new InvalidItem(`items[${index}] (sample ${item.sampleId}): metadata_json needs an "answer" string or number`);
  }
  return metadata;
}

function sameNumber(a, b) {
  const numeric = /^[+-]?(\d+\.?\d*|\.\d+)(e[+-]?\d+)?$/i;
  return numeric.test(a) && numeric.test(b) && Number(a) === Number(b);
}

// Compared by code points, so a character outside the BMP counts once.
function charMatch(a, b) {
  const x = Array.from(a);
  const y = Array.from(b);
  const longer = Math.max(x.length, y.length);
  if (longer === 0) return 1;
  let same = 0;
  for (let i = 0; i < Math.min(x.length, y.length); i++) if (x[i] === y[i]) same++;
  return same / longer;
}

/** The ScoreResult of one ScoreItem; throws InvalidItem when the item is malformed. */
function scoreItem(item, index) {
  const answer = String(parseMetadata(item, index).answer).trim();
  const completion = item.completion.trim();
  const exact = completion === answer || sameNumber(completion, answer);
  const match = charMatch(completion, answer);
  return {
    sampleId: item.sampleId,
    reward: exact ? 1 : match,
    components: { exact: exact ? 1 : 0, char_match: match },
    tokenRewards: [],
    error: "",
  };
}

module.exports = { InvalidItem, scoreItem };
