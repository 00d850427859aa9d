// Greedy split generation with static/split_client.js under Node (HTTP transport: Node 20 has no WebSocket).
// usage: node split_greedy.mjs NODE_URL PROMPT_IDS_JSON N OUT_JSON [REPETITION_PENALTY]
import { writeFileSync } from "node:fs";
import { SplitClient } from "../../dtrain/static/split_client.js";

const [url, promptJson, n, outPath, penalty = "1.0"] = process.argv.slice(2);
const client = await new SplitClient(url).init({ useWebSocket: false });
const ids = await client.generate(JSON.parse(promptJson), Number(n), {
  temperature: 0, repetitionPenalty: Number(penalty),
});
writeFileSync(outPath, JSON.stringify({ ids, last: { ...client.lastAnswer, pre_activations: undefined } }));
client.close();
