package scorer

import (
	"context"
	"encoding/json"
	"strings"

	fwkplugin "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/plugin"
	fwkrc "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/requestcontrol"
	fwkrh "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/requesthandling"
	fwksched "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/scheduling"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/plugins/requesthandling/parsers/openai"
)

// ParserType is GAIE's OpenAI parser that also reads the engine's cached-token figure.
// GAIE 1.5.0's own parser looks for usage.prompt_token_details, a key no engine writes
// (OpenAI, vLLM and SGLang write prompt_tokens_details), so with it the reuse the
// engine reports never reaches the response plugins. Select it with
// `parser: {pluginRef: kvix-openai-parser}`.
const ParserType = "kvix-openai-parser"

// Parser is GAIE's OpenAI parser with usage.prompt_tokens_details read too.
type Parser struct {
	*openai.OpenAIParser
	typedName fwkplugin.TypedName
}

var _ fwkrh.Parser = (*Parser)(nil)

// ParserFactory builds the parser plugin.
func ParserFactory(name string, _ json.RawMessage, _ fwkplugin.Handle) (fwkplugin.Plugin, error) {
	return &Parser{OpenAIParser: openai.NewOpenAIParser(),
		typedName: fwkplugin.TypedName{Type: ParserType, Name: name}}, nil
}

// TypedName is the plugin's type and name.
func (p *Parser) TypedName() fwkplugin.TypedName { return p.typedName }

// ParseRequest is GAIE's.
func (p *Parser) ParseRequest(ctx context.Context, body []byte, headers map[string]string) (*fwksched.LLMRequestBody, error) {
	return p.OpenAIParser.ParseRequest(ctx, body, headers)
}

// ParseResponse is GAIE's, with the cached tokens of usage.prompt_tokens_details
// (a whole response, or the usage chunk of a stream sent with include_usage).
func (p *Parser) ParseResponse(ctx context.Context, body []byte, headers map[string]string, end bool) (*fwkrh.ParsedResponse, error) {
	res, err := p.OpenAIParser.ParseResponse(ctx, body, headers, end)
	if err != nil || res == nil || res.Usage == nil || res.Usage.PromptTokenDetails != nil {
		return res, err
	}
	if cached, ok := cachedTokens(body); ok {
		res.Usage.PromptTokenDetails = &fwkrc.PromptTokenDetails{CachedTokens: cached}
	}
	return res, nil
}

// cachedTokens finds usage.prompt_tokens_details.cached_tokens in a JSON body or in
// the data: lines of a server-sent event stream. An absent or null figure is no figure.
func cachedTokens(body []byte) (int, bool) {
	var doc struct {
		Usage *struct {
			Details *struct {
				Cached *int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	try := func(b []byte) (int, bool) {
		doc.Usage = nil
		if json.Unmarshal(b, &doc) != nil || doc.Usage == nil || doc.Usage.Details == nil || doc.Usage.Details.Cached == nil {
			return 0, false
		}
		return *doc.Usage.Details.Cached, true
	}
	if n, ok := try(body); ok {
		return n, true
	}
	for _, line := range strings.Split(string(body), "\n") {
		if data, ok := strings.CutPrefix(strings.TrimSpace(line), "data:"); ok {
			if n, ok := try([]byte(strings.TrimSpace(data))); ok {
				return n, true
			}
		}
	}
	return 0, false
}
