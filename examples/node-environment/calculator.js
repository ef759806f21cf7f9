// The environment's rule, apart from gRPC: the calculator word problem of rlmesh's built-in
// `calculator` environment (rlmesh/environments/calculator.py). The model may call the calculator
// tool and gets its result as a tool message; its answer in \boxed{} ends the episode with reward 1
// when it is right.
"use strict";

const TOOL_SYSTEM = "Tool: calculator(expression). Answer as \\boxed{n}.";
const INSTRUCTION = " Put the final answer in \\boxed{}.";
const MAX_EXPRESSION = 64;
const MAX_CONSTANT = 10n ** 9n;
const BOXED = /\\boxed\{\s*(-?\d+)\s*\}/;

/** A row the environment refuses; the server answers it with INVALID_ARGUMENT and this message. */
class InvalidRow extends Error {}

class ExpressionError extends Error {}

// Values follow Python's arithmetic, as the Python environment computes them: integers (BigInt)
// stay exact under + - *, and / gives a float (Number), as does any operation with a float.
function apply(op, a, b) {
  if (op === "/") {
    if (Number(b) === 0) throw new ExpressionError("division by zero");
    return Number(a) / Number(b);
  }
  if (typeof a === "bigint" && typeof b === "bigint") {
    return op === "+" ? a + b : op === "-" ? a - b : a * b;
  }
  const [x, y] = [Number(a), Number(b)];
  return op === "+" ? x + y : op === "-" ? x - y : x * y;
}

// A recursive-descent parser over the expression's text, evaluated as it parses (no eval):
//   expr := term (("+" | "-") term)*      term := unary (("*" | "/") unary)*
//   unary := "-" unary | primary          primary := integer | "(" expr ")"
function parseExpression(text) {
  let at = 0;
  const skip = () => { while (at < text.length && /\s/.test(text[at])) at++; };
  const peek = () => { skip(); return text[at]; };

  function expr() {
    let value = term();
    for (let op = peek(); op === "+" || op === "-"; op = peek()) {
      at++;
      value = apply(op, value, term());
    }
    return value;
  }

  function term() {
    let value = unary();
    for (let op = peek(); op === "*" || op === "/"; op = peek()) {
      at++;
      value = apply(op, value, unary());
    }
    return value;
  }

  function unary() {
    if (peek() === "-") {
      at++;
      return -unary(); // BigInt or Number alike
    }
    return primary();
  }

  function primary() {
    const next = peek();
    if (next === undefined) throw new ExpressionError("unexpected end of expression");
    if (next === "(") {
      at++;
      const value = expr();
      if (peek() !== ")") throw new ExpressionError(`expected ")" at position ${at}`);
      at++;
      return value;
    }
    const digits = /^\d+/.exec(text.slice(at));
    if (digits === null || /^[.\w]/.test(text.slice(at + digits[0].length))) {
      throw new ExpressionError("only integers, + - * / and parentheses");
    }
    at += digits[0].length;
    const value = BigInt(digits[0]);
    if (value >= MAX_CONSTANT) throw new ExpressionError("only integers, + - * / and parentheses");
    return value;
  }

  const value = expr();
  if (peek() !== undefined) {
    throw new ExpressionError(/[\d()+\-*/]/.test(text[at]) ? `unexpected "${text[at]}" at position ${at}` : "only integers, + - * / and parentheses");
  }
  return value;
}

// Python's "{:.4g}": 4 significant digits, trailing zeros dropped, exponent form outside 1e-4..1e4.
function fourSignificant(value) {
  const [mantissa, exponentText] = value.toExponential(3).split("e");
  const exponent = Number(exponentText);
  const trim = (s) => (s.includes(".") ? s.replace(/\.?0+$/, "") : s);
  if (exponent < -4 || exponent >= 4) {
    const sign = exponent < 0 ? "-" : "+";
    return `${trim(mantissa)}e${sign}${String(Math.abs(exponent)).padStart(2, "0")}`;
  }
  return trim(value.toFixed(3 - exponent));
}

/** The value of an integer expression with + - * / and parentheses, as text; an error's text otherwise. */
function evaluate(expression) {
  if (expression.length > MAX_EXPRESSION) {
    return `error: expression longer than ${MAX_EXPRESSION} characters`;
  }
  let value;
  try {
    value = parseExpression(expression);
  } catch (error) {
    if (error instanceof ExpressionError) return `error: ${error.message}`;
    throw error;
  }
  if (typeof value === "bigint") {
    return value.toString();
  }
  if (Number.isInteger(value)) {
    return BigInt(value).toString();
  }
  return fourSignificant(value);
}

/** The problem's text from a word-problem row (its user message, without the task's instruction). */
function questionOf(row) {
  let prompt = row.prompt;
  if (Array.isArray(prompt)) {
    const user = prompt.find((m) => m !== null && typeof m === "object" && m.role === "user");
    prompt = user === undefined ? undefined : user.content ?? "";
  }
  if (typeof prompt !== "string" || prompt === "") {
    throw new InvalidRow(`calculator: the row has no problem text under 'prompt' (keys: ${JSON.stringify(Object.keys(row).sort())})`);
  }
  return prompt.replace(INSTRUCTION, "");
}

/** Parses a Reset's row_json: the answer to keep and the first messages. Throws InvalidRow. */
function reset(rowJson) {
  let row;
  try {
    row = JSON.parse(rowJson);
  } catch (error) {
    throw new InvalidRow(`calculator: row_json is not valid JSON: ${error.message}`);
  }
  if (row === null || typeof row !== "object" || Array.isArray(row)) {
    throw new InvalidRow(`calculator: row_json must be a JSON object, got ${rowJson}`);
  }
  if (!("answer" in row) || row.answer === null) {
    throw new InvalidRow(`calculator: the row has no 'answer' (keys: ${JSON.stringify(Object.keys(row).sort())})`);
  }
  const answer = String(row.answer).trim();
  const messages = [{ role: "system", content: TOOL_SYSTEM }, { role: "user", content: questionOf(row) }];
  return { answer, messages };
}

function expressionOf(args) {
  let parsed;
  try {
    parsed = JSON.parse(args);
  } catch {
    return "";
  }
  if (parsed === null || typeof parsed !== "object" || Array.isArray(parsed)) return "";
  return parsed.expression === undefined || parsed.expression === null ? "" : String(parsed.expression);
}

/** One turn: calculator calls are answered (reward 0, not done); otherwise the \boxed{} answer ends it. */
function step(answer, text, toolCalls) {
  const calls = toolCalls.filter((c) => c.name === "calculator");
  if (calls.length > 0) {
    const messages = calls.map((c) => ({ role: "tool", content: evaluate(expressionOf(c.arguments)), toolCallId: c.id }));
    return { messages, reward: 0, done: false };
  }
  const found = BOXED.exec(text);
  return { messages: [], reward: found !== null && found[1] === answer ? 1 : 0, done: true };
}

module.exports = { InvalidRow, evaluate, questionOf, reset, step, TOOL_SYSTEM };
