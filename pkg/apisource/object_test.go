package apisource

import (
	"strings"
	"testing"
)

// --config-source names the object: its kind, with the defaults of the upstream DaemonSet's.
func TestParseObject(t *testing.T) {
	for _, tt := range []struct{ in, want, err string }{
		{"configmap", "configmap kube-system/ip-masq-agent", ""},
		{"configmap:team/masq", "configmap team/masq", ""},
		{"crd", "ipmasqagentconfig default", ""},
		{"crd:edge", "ipmasqagentconfig edge", ""},
		{"configmap:masq", "", "want configmap:NAMESPACE/NAME"},
		{"crd:a/b", "", "cluster-scoped"},
		{"secret", "", "want file, configmap"},
	} {
		o, err := ParseObject(tt.in)
		if tt.err != "" {
			if err == nil || !strings.Contains(err.Error(), tt.err) {
				t.Errorf("%s: %v, want an error with %q", tt.in, err, tt.err)
			}
			continue
		}
		if err != nil || o.String() != tt.want {
			t.Errorf("%s: %v, %v; want %s", tt.in, o, err, tt.want)
		}
	}
}
