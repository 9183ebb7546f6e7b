// One agent run with the Vercel AI SDK (`generateText` + a tool), pointed at runcap.
// Called by tests/system/test_frameworks.py: `node vercel_agent.mjs '{"baseURL", "headers", "api"}'`;
// prints one JSON line: the run's outcome, or the error the SDK raised.
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, stepCountIs, tool } from "ai";
import { z } from "zod";

const { baseURL, headers, api, manualChars } = JSON.parse(process.argv[2]);
const provider = createOpenAI({ baseURL, apiKey: "sk-test", headers });
// The provider's default model speaks the Responses API; `.chat` the chat completions API.
const model = api === "chat" ? provider.chat("gpt-4o-mini") : provider("gpt-4o-mini");

// The same tool as the Python agents: a short answer, or a long document for "the whole manual".
const lookup = tool({
  description: "Look up an order or a document.",
  inputSchema: z.object({ query: z.string() }),
  execute: async ({ query }) =>
    query === "the whole manual" ? "manual: " + "x".repeat(manualChars) : `found ${query}`,
});

try {
  const result = await generateText({
    model,
    tools: { lookup },
    stopWhen: stepCountIs(10),
    prompt: "Refund orders A1 and B2.",
  });
  console.log(JSON.stringify({ ok: true, text: result.text, steps: result.steps.length }));
} catch (e) {
  console.log(
    JSON.stringify({
      ok: false,
      name: e?.name,
      statusCode: e?.statusCode ?? null,
      isRetryable: e?.isRetryable ?? null,
      message: String(e?.message ?? e),
    }),
  );
}
