package scheduler_test

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"
)

func jsonUnmarshal(b []byte, v any) error { return json.Unmarshal(b, v) }

// metadataValue returns the raw JSON under key in a job's metadata.
func metadataValue(t *testing.T, metadata []byte, key string) json.RawMessage {
	t.Helper()
	var m map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(metadata, &m))
	return m[key]
}
