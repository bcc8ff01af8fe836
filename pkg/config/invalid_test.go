package config_test

import (
	"strings"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config/configtest"
)

// Every validation failure names the key (and entry), the bad value and what is wrong.
func TestValidationErrors(t *testing.T) {
	for _, tt := range configtest.Invalid {
		t.Run(tt.Name, func(t *testing.T) {
			_, err := config.Parse([]byte(tt.Doc), config.Options{EnableIPv6: tt.EnableIPv6})
			if err == nil {
				t.Fatalf("Parse(%q) succeeded, want an error", tt.Doc)
			}
			for _, w := range tt.Wants {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
}
